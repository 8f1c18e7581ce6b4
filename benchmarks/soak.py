"""Soak: one request decoded for 1,000 steps on the tiny model under each placement, with the
process's resident memory (RSS) at steps 100 and 1,000. Anything a decode step leaves behind
(host buffers, undonated caches, recompiles) shows as growth between the two.

    PYTHONPATH=. python benchmarks/soak.py [--steps 1000] [--placements a,b] [--json]

It drives the engine's own jitted prefill and decode step with its donated KV cache, as
`Engine.generate` does, but keeps nothing per step: generate's token and logits lists are
its output, not a leak. Several minutes on two shared CPU cores.

Growth under weight_prefetch alone is glibc's, not ours: its all-gathers free host buffers of
a few hundred KB every step, glibc then raises its mmap threshold and serves them from a heap
that fragments. With MALLOC_MMAP_THRESHOLD_=131072 (threshold fixed) it levels off within
the first 300 steps (+8 MB) and stays flat to step 1,000.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402

import moejax  # noqa: E402, F401  (before jax: it starts jax on this host's platform, quietly)

# isort: split
import jax.numpy as jnp  # noqa: E402

from moejax.config import PRESETS, Config, EngineConfig, LayoutConfig  # noqa: E402
from moejax.engine.engine import MIN_POSITIONS, Engine, bucket  # noqa: E402
from moejax.engine.sampling import Sampling, sample  # noqa: E402
from moejax.launch.loading import load_params  # noqa: E402
from sharding import make_placement, names  # noqa: E402

PROMPT = [3, 17, 45, 2, 88, 61, 9, 30]
LAYOUTS = {name: LayoutConfig(placement=name, devices=8) for name in names()}


def rss_mb() -> float:
    gc.collect()
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def soak(name: str, steps: int, marks: tuple[int, ...]) -> dict[int, float]:
    max_len = bucket(len(PROMPT) + steps, MIN_POSITIONS)
    config = Config(model=PRESETS["tiny"], layout=LAYOUTS[name], engine=EngineConfig(max_seq_len=max_len)).validate()
    placement = make_placement(config)
    engine = Engine(config, load_params(config, placement), placement)
    engine.generate([PROMPT], 2)  # compiles prefill and decode for this cache size
    tokens, lens = engine._padded([PROMPT])
    cache = engine.new_cache(tokens.shape[0], max_len)
    logits, cache, _ = engine._run_prefill(
        cache, tokens, lens, all_logits=False, record=False, dealer=None, prompt_lens=[len(PROMPT)]
    )
    seeds, greedy = jnp.zeros_like(lens), Sampling()
    tok, lens = sample(logits, greedy, seeds, lens), jnp.asarray(lens)
    rss = {}
    for step in range(1, steps + 1):
        tok, _, cache, _ = engine._decode(engine.params, cache, tok, lens, seeds, step, sampling=greedy, record=False)
        if step in marks:
            tok.block_until_ready()
            rss[step] = rss_mb()
    return rss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--placements", default=",".join(names()))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    marks = (min(100, args.steps), args.steps)
    rows = {name: soak(name, args.steps, marks) for name in args.placements.split(",")}
    if args.json:
        print(json.dumps({name: {str(k): round(v, 1) for k, v in r.items()} for name, r in rows.items()}))
        return
    print(f"{'placement':<16}{f'RSS@{marks[0]} MB':>14}{f'RSS@{marks[1]} MB':>15}{'growth MB':>11}")
    for name, r in rows.items():
        print(f"{name:<16}{r[marks[0]]:>14.1f}{r[marks[1]]:>15.1f}{r[marks[1]] - r[marks[0]]:>11.1f}")


if __name__ == "__main__":
    main()
