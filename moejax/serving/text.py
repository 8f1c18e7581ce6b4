"""Text in and out for the command-line verbs: prompts as text or ids, stop rules, results."""

from __future__ import annotations

import argparse

from moejax.base.errors import UsageError
from moejax.serving.stopping import Stopper
from moejax.serving.tokenizer import Tokenizer, eos_ids


def stop_ids_arg(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stop-ids {text!r} is not a comma-separated list of integers") from None


def add_text_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", metavar="DIR", help="directory with tokenizer.json (default: the --hf directory)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument(
        "--stop-ids",
        type=stop_ids_arg,
        action="append",
        default=[],
        metavar="IDS",
        help="stop token ids 1,2 (besides the model's end-of-sequence ids)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence ids")


def load_tokenizer(args) -> Tokenizer | None:
    return Tokenizer.for_run(args.tokenizer, args.hf)


def model_stop_ids(args, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """End-of-sequence ids (unless --ignore-eos) and --stop-ids."""
    eos = () if args.ignore_eos else tokenizer.eos_ids if tokenizer else (eos_ids(args.hf) or ()) if args.hf else ()
    return tuple(eos) + tuple(i for ids in args.stop_ids for i in ids)


def encode_prompts(items: list, tokenizer: Tokenizer | None, chat: bool) -> list[list[int]]:
    """Prompts given as ids (lists) or text (str, a user message under --chat) -> token ids."""
    if any(isinstance(p, str) for p in items) and tokenizer is None:
        raise UsageError("--prompt needs a tokenizer: --hf DIR or --tokenizer DIR with tokenizer.json")
    if chat and any(isinstance(p, list) for p in items):
        raise UsageError("--chat applies the chat template to text; give --prompt TEXT, not --prompt-ids")
    if chat:
        return [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in items]
    return [tokenizer.encode(p) if isinstance(p, str) else p for p in items]


def stopped(tokens: list[int], tokenizer: Tokenizer | None, stop_ids, stop_strings) -> Stopper:
    """A finished request's tokens replayed through its stop rules."""
    s = Stopper(tokenizer, stop_ids, stop_strings)
    for t in tokens:
        s.add(t)
        if s.finish_reason:
            return s
    s.finish_length()
    return s
