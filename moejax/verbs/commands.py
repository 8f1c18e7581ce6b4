"""The `generate` and `score` verbs: argument parsing and output only; the work happens in the
engine and the placements."""

from __future__ import annotations

import dataclasses
import json

from moejax.base.errors import UsageError
from moejax.launch.factory import build_engine, mtp_engine, pd_engines
from moejax.launch.flags import (
    add_model_args,
    add_page_args,
    add_pd_args,
    config_from_args,
    natural_routing_only,
    pd_apart,
    prompt_ids,
)


def cmd_generate(args) -> int:
    from moejax.engine.sampling import Sampling

    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise UsageError(
            f"sampling needs --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1; got "
            f"{args.temperature}, {args.top_k}, {args.top_p}"
        )
    from moejax.engine import compile_clock
    from moejax.serving import text

    tokenizer = text.load_tokenizer(args)
    prompts, extra = text.encode_prompts(args.prompt_ids or [[1]], tokenizer, args.chat), {}
    stop_ids = text.model_stop_ids(args, tokenizer)
    config = config_from_args(args, host_default=True)
    if args.speculative:
        natural_routing_only(config, "--speculative mtp")
    compile_clock.start()
    t0 = compile_clock.now()
    if pd_apart(args):
        from moejax.engine.disaggregated import Disaggregated

        prefill_engine, decode_engine = pd_engines(config, args)
        if args.speculative:
            prefill_engine = mtp_engine(prefill_engine, args)
            decode_engine = mtp_engine(decode_engine, args, others=[prefill_engine])
        engine = Disaggregated(prefill_engine, decode_engine)
    else:
        engine = build_engine(config, args.hf, args.seed, args.checkpoint)
        if args.speculative:
            engine = mtp_engine(engine, args)
    t1 = compile_clock.now()
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if (args.top_k or args.top_p < 1.0) and sampling.greedy:
        sampling = dataclasses.replace(sampling, temperature=1.0)
    gen = engine.generate(prompts, args.max_new_tokens, sampling, seed=args.sample_seed)
    if args.speculative:
        extra = {"acceptance_rate": gen.acceptance_rate}
    # A static batch runs every request to max_new_tokens; the stop rules then cut each one.
    done = [text.stopped(t, tokenizer, stop_ids, args.stop) for t in gen.tokens]
    if tokenizer is not None:
        extra["text"] = [d.text for d in done]
    if args.json:
        # Disjoint parts of the run: loading less its compiles, all compiles (or cache loads),
        # then the model's own prefill and mean decode step.
        timing = {
            "load_s": round(t1 - t0 - compile_clock.compile_seconds(t0, t1), 3),
            "compile_s": round(compile_clock.compile_seconds(t0), 3),
            "prefill_ms": round(gen.prefill_ms, 2),
            "decode_step_ms": round(gen.step_ms if args.speculative else gen.decode_step_ms, 2),
        }
        if pd_apart(args):
            timing.update(handover_ms=round(gen.handover_ms, 3), handover_bytes=gen.handover_bytes)
        print(
            json.dumps(
                {
                    "tokens": [d.tokens for d in done],
                    "finish_reasons": [d.finish_reason for d in done],
                    **extra,
                    "timing": timing,
                }
            )
        )
    else:
        for i, d in enumerate(done):
            print(f"request {i}: {' '.join(map(str, d.tokens))}" + (f"\n  {d.text!r}" if tokenizer else ""))
    return 0


def cmd_score(args) -> int:
    from moejax.engine.logprobs import prompt_logprobs
    from moejax.serving.text import encode_prompts
    from moejax.serving.tokenizer import Tokenizer

    prompts = encode_prompts(args.prompt_ids or [[1]], Tokenizer.for_run(args.tokenizer, args.hf), chat=False)
    engine = build_engine(config_from_args(args, host_default=True), args.hf, args.seed, args.checkpoint)
    logits = engine.score(prompts)
    scored = [prompt_logprobs(x, p, args.top_logprobs) for x, p in zip(logits, prompts)]
    if args.json:
        print(json.dumps({"logits": [x.tolist() for x in logits], "logprobs": scored}))
    else:
        for i, (x, lp) in enumerate(zip(logits, scored)):
            total = sum(v for v in lp["token_logprobs"] if v is not None)
            print(
                f"request {i}: {x.shape[0]} positions, argmax {x.argmax(-1).tolist()}, "
                f"log-likelihood {total:.4f}, token logprobs {lp['token_logprobs']}"
            )
    return 0


def register(sub) -> None:
    from moejax.serving.text import add_text_args as text_args

    g = sub.add_parser("generate", help="generate tokens for one batch of prompts")
    add_model_args(g)
    add_page_args(g)
    g.add_argument("--prompt-ids", type=prompt_ids, action="append", help="1,2,3 (repeat: one request each)")
    g.add_argument(
        "--prompt",
        dest="prompt_ids",
        action="append",
        metavar="TEXT",
        help="prompt text (repeatable; in order with --prompt-ids)",
    )
    g.add_argument(
        "--chat", action="store_true", help="each --prompt is a user message under the model's chat template"
    )
    text_args(g)
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument(
        "--sample-seed",
        type=int,
        default=0,
        help='seed of sampling: prompt i samples with seed S + i, what `serve` samples for a request with that "seed"',
    )
    g.add_argument("--speculative", choices=("mtp",), help="speculative decoding with the model's MTP draft module")
    g.add_argument("--mtp-init", choices=("random",), help="a random MTP module when the checkpoint carries none")
    add_pd_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("score", help="logits and per-token logprobs of one prefill")
    add_model_args(s)
    s.add_argument("--prompt-ids", type=prompt_ids, action="append", help="1,2,3 (repeat: one request each)")
    s.add_argument(
        "--prompt",
        dest="prompt_ids",
        action="append",
        metavar="TEXT",
        help="prompt text (repeatable; in order with --prompt-ids)",
    )
    s.add_argument("--tokenizer", metavar="DIR", help="directory with tokenizer.json (default: the --hf directory)")
    s.add_argument(
        "--top-logprobs",
        type=int,
        default=0,
        choices=range(0, 21),
        metavar="N",
        help="the N best alternatives of every position (0..20), as the server's logprobs",
    )
    s.set_defaults(func=cmd_score)
