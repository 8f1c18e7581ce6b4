"""MTP speculative decoding against plain decoding on the tiny GLM-5 models: tokens per step,
step time and time per token, greedy, single device.

Drafts: `mirror` (a one-layer target and a draft repeating its layer: acceptance is high),
`random` (a random MTP module: nearly every draft is rejected, the cost of a useless draft).
Run: python benchmarks/mtp.py [--json] [--new-tokens 64] [--batch 1 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from moejax.config import Config, preset
from moejax.engine.engine import Engine
from moejax.engine.speculative import SpeculativeEngine
from moejax.launch.loading import load_mtp, load_params
from moejax.model.mtp import mirrored_draft
from sharding import make_placement


def setups(smoke: bool = False):
    """(model name, draft name, plain engine, speculative engine) per benchmarked pair (the first
    only for `smoke`)."""
    one_layer = dataclasses.replace(preset("tiny-glm5"), num_layers=1, dense_layers=(), dsa_shared_layers=())
    for name, model, drafts in (
        ("tiny-glm5 1 layer", one_layer, ("mirror", "random")),
        ("tiny-glm5", preset("tiny-glm5"), ("random",)),
    ):
        config = Config(model=model).validate()
        placement = make_placement(config)
        params = load_params(config, placement)
        for draft in drafts:
            if draft == "mirror":
                target, mtp = mirrored_draft(params, model)
            else:
                target, mtp = params, load_mtp(config, placement)
            engine = Engine(config, target, placement)
            yield name, draft, engine, SpeculativeEngine(engine, mtp)
            if smoke:
                return


def run(batch: int, new_tokens: int, prompt_len: int = 40, smoke: bool = False):
    rng = np.random.RandomState(0)
    rows = []
    for model, draft, engine, spec in setups(smoke):
        prompts = [rng.randint(0, engine.c.vocab_size, prompt_len).tolist() for _ in range(batch)]
        engine.generate(prompts, new_tokens)  # compile
        spec.generate(prompts, new_tokens)
        plain = engine.generate(prompts, new_tokens)
        gen = spec.generate(prompts, new_tokens)
        assert gen.tokens == plain.tokens, "greedy MTP must equal plain greedy"
        per_step = 1 + gen.acceptance_rate
        rows.append(
            dict(
                model=model,
                draft=draft,
                batch=batch,
                acceptance_rate=round(gen.acceptance_rate, 3),
                tokens_per_step=round(per_step, 3),
                plain_step_ms=round(plain.decode_step_ms, 2),
                mtp_step_ms=round(gen.step_ms, 2),
                plain_ms_per_token=round(plain.decode_step_ms, 2),
                mtp_ms_per_token=round(gen.step_ms / per_step, 2),
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="the first pair only (one-layer target, mirrored draft)")
    args = ap.parse_args(argv)
    rows = [r for b in args.batch for r in run(b, args.new_tokens, smoke=args.smoke)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
