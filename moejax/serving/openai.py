"""OpenAI-compatible request bodies -> scheduler requests.

Checks every field a client sends and raises UsageError with one line for anything wrong (the
server answers 400 with it): each field is implemented, ignored on purpose (IGNORED), or refused
with its name (REFUSED, or an unknown field). Extensions as vLLM names them: `top_k`,
`min_tokens`, `stop_token_ids`, `ignore_eos`, and `token_ids` in each choice.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random

from moejax.base.errors import UsageError
from moejax.engine.logprobs import MAX_TOP
from moejax.serving.request import Request
from moejax.serving.stopping import Stopper

DEFAULT_MAX_TOKENS = 16
MAX_LOGIT_BIAS = 300  # entries, OpenAI's limit
COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "logit_bias",
    "top_k",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
}
FIELDS = {
    False: COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"},
    True: COMMON
    | {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "parallel_tool_calls",
    },
}
# Accepted and ignored on purpose: they change nothing a model computes.
IGNORED = {"user", "metadata", "store", "service_tier"}
# Refused unless given their no-op value: what moejax does not compute.
NEUTRAL = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "min_p": 0,
    "suffix": "",
    "tools": [],
    "functions": [],
    "tool_choice": "none",
    "function_call": "none",
    "parallel_tool_calls": False,
}


def load_body(raw: bytes):
    """The JSON body; NaN, Infinity and numbers too large for a float are refused."""

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise UsageError(f"the request holds the non-finite number {text}: every number must be finite")
        return value

    def constant(name: str):
        raise UsageError(f"the request holds the non-finite number {name}: every number must be finite")

    try:
        return json.loads(raw, parse_float=finite, parse_constant=constant)
    except ValueError as e:
        raise UsageError(f"the request body is not valid JSON: {e}") from None


def _field(body: dict, name: str, kinds, default):
    value = body.get(name, default)
    if value is None:
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise UsageError(f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    return value


def _int_list(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise UsageError(f"'{name}' must be a list of integers")
    return value


def _refuse_unserved(body: dict, chat: bool) -> None:
    for name in body:
        if name not in FIELDS[chat] and name not in IGNORED:
            raise UsageError(f"unknown field '{name}' for /v1/{'chat/' if chat else ''}completions")
    for name, neutral in NEUTRAL.items():
        if body.get(name) not in (None, neutral):
            raise UsageError(f"'{name}' is not supported by this server (only {json.dumps(neutral)})")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise UsageError(
            '\'response_format\' is not supported by this server (structured output): only {"type": "text"}'
        )


def prompts_of(body: dict, tokenizer, chat: bool) -> list[list[int]]:
    """The prompts' token ids: chat `messages`, or `prompt` as text, token ids, or a list of either."""
    if chat:
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise UsageError('\'messages\' must be a non-empty list of {"role": str, "content": str}')
        if tokenizer is None:
            raise UsageError("chat needs a tokenizer with a chat template; this server has no tokenizer")
        return [tokenizer.encode_chat([{"role": m["role"], "content": m["content"]} for m in messages])]
    prompt = body.get("prompt")
    batch = (
        prompt if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) else [prompt]
    )
    out = []
    for p in batch:
        if isinstance(p, str):
            if tokenizer is None:
                raise UsageError("this server has no tokenizer: give 'prompt' as token ids")
            out.append(tokenizer.encode(p))
        elif isinstance(p, list):
            out.append(_int_list(p, "prompt"))
        else:
            raise UsageError("'prompt' must be a string, a list of token ids, or a list of either")
    return out


@dataclasses.dataclass
class Job:
    """One HTTP request: its choices in index order (prompt i's n samples at i*n .. i*n + n - 1)
    and the requests the scheduler runs (each prompt's first sample, carrying the others)."""

    choices: list[Request]
    submit: list[Request]
    chat: bool
    stream: bool
    echo: bool
    logprobs: int | None  # alternatives per token; None: no logprobs
    include_usage: bool


def _logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        top = _field(body, "top_logprobs", int, None)
        if not _field(body, "logprobs", bool, False):
            if top is not None:
                raise UsageError("'top_logprobs' needs 'logprobs': true")
            return None
        n = 0 if top is None else top
    else:
        n = _field(body, "logprobs", int, None)
        if n is None:
            return None
    if not 0 <= n <= MAX_TOP:
        raise UsageError(f"'{'top_logprobs' if chat else 'logprobs'}' must be 0..{MAX_TOP}, got {n}")
    return n


def _logit_bias(body: dict) -> dict[int, float]:
    bias = _field(body, "logit_bias", dict, {})
    if len(bias) > MAX_LOGIT_BIAS:
        raise UsageError(f"'logit_bias' holds {len(bias)} entries; at most {MAX_LOGIT_BIAS}")
    out = {}
    for k, v in bias.items():
        if (
            not k.lstrip("-").isdigit()
            or isinstance(v, bool)
            or not isinstance(v, (int, float))
            or not -100 <= v <= 100
        ):
            raise UsageError(f"'logit_bias' maps token ids to numbers in -100..100; got {k!r}: {v!r}")
        out[int(k)] = float(v)
    return out


def to_job(body, *, tokenizer, eos_ids, chat: bool, max_len: int) -> Job:
    """A (completions or chat) body as the scheduler's requests; max_len: the longest request allowed."""
    if not isinstance(body, dict):
        raise UsageError("the request body must be a JSON object")
    _refuse_unserved(body, chat)
    prompts = prompts_of(body, tokenizer, chat)
    n = _field(body, "n", int, 1)
    if n < 1:
        raise UsageError(f"'n' must be at least 1, got {n}")
    best_of = _field(body, "best_of", int, n)
    if best_of != n:
        raise UsageError(f"'best_of' {best_of} other than n is not supported (every sample is returned)")
    echo = _field(body, "echo", bool, False)
    stream = _field(body, "stream", bool, False)
    if echo and stream:
        raise UsageError("'echo' with 'stream' is not supported: ask the whole answer")
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    asked = _field(body, name, int, None)
    if asked is not None and asked < (0 if echo else 1):
        raise UsageError(
            f"'{name}' must be at least {0 if echo else 1}{'' if echo else ' (0 only with echo)'}, got {asked}"
        )
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise UsageError("'stop' must be a string or a list of strings")
    stop_ids = _int_list(_field(body, "stop_token_ids", list, []), "stop_token_ids")
    if not _field(body, "ignore_eos", bool, False):
        stop_ids = list(eos_ids) + stop_ids
    logprobs, bias = _logprobs(body, chat), _logit_bias(body)
    min_tokens = _field(body, "min_tokens", int, 0)
    if min_tokens < 0:
        raise UsageError(f"'min_tokens' must be at least 0, got {min_tokens}")
    top_k = _field(body, "top_k", int, 0)
    seed = _field(body, "seed", int, None)
    options = _field(body, "stream_options", dict, {})
    choices, submit = [], []
    for ids in prompts:
        if asked is not None and len(ids) + asked > max_len:
            raise UsageError(
                f"prompt of {len(ids)} tokens + {name} {asked} = {len(ids) + asked} exceeds the longest "
                f"request of {max_len} positions"
            )
        max_tokens = asked if asked is not None else max(1, min(DEFAULT_MAX_TOKENS, max_len - len(ids)))
        if min_tokens > max_tokens:
            raise UsageError(f"'min_tokens' {min_tokens} exceeds {name} {max_tokens}")
        first = seed if seed is not None else random.getrandbits(31)
        samples = [
            Request(
                prompt=ids,
                max_tokens=max_tokens,
                stopper=Stopper(tokenizer, stop_ids, stop),
                temperature=float(_field(body, "temperature", (int, float), 1.0)),
                top_p=float(_field(body, "top_p", (int, float), 1.0)),
                top_k=max(0, top_k),  # vLLM: -1 = off
                seed=(first + j) & 0x7FFFFFFF,
                logprobs=logprobs,
                echo_logprobs=echo and logprobs is not None,
                logit_bias=bias,
                min_tokens=min_tokens,
            )
            for j in range(n)
        ]
        samples[0].samples = samples[1:]
        choices += samples
        submit.append(samples[0])
    return Job(choices, submit, chat, stream, echo, logprobs, bool(options.get("include_usage")))


def tokenize(body, tokenizer, max_len: int) -> dict:
    """vLLM's /tokenize: {"prompt": text, "add_special_tokens"} or {"messages": [...]} -> ids."""
    if not isinstance(body, dict):
        raise UsageError("the request body must be a JSON object")
    for name in body:
        if name not in ("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"):
            raise UsageError(f"unknown field '{name}' for /tokenize")
    if tokenizer is None:
        raise UsageError("this server has no tokenizer")
    if "messages" in body:
        if not _field(body, "add_generation_prompt", bool, True):
            raise UsageError("'add_generation_prompt': false is not supported")
        ids = prompts_of(body, tokenizer, chat=True)[0]
    else:
        ids = tokenizer.encode(_field(body, "prompt", str, None) or "", _field(body, "add_special_tokens", bool, True))
    return {"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": None}


def detokenize(body, tokenizer, vocab: int) -> dict:
    """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
    if not isinstance(body, dict):
        raise UsageError("the request body must be a JSON object")
    for name in body:
        if name not in ("model", "tokens"):
            raise UsageError(f"unknown field '{name}' for /detokenize")
    if tokenizer is None:
        raise UsageError("this server has no tokenizer")
    ids = _int_list(body.get("tokens"), "tokens")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise UsageError(f"token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")
    return {"prompt": tokenizer.decode(ids)}
