"""`moejax generate --hf DIR` as a user runs it, its marginal costs, A/B over process settings.

    python benchmarks/cli_marginal.py [--rounds 2] NAME=ENV[,ENV...] ...

The model of model_vs_transformers. Each measure is the wall-time difference of two whole CLI
runs (warm compile cache), so start-up and compiling cancel: prefill tokens/s from 1,024
against 64 prompt tokens (1 new token); decode tokens/s at batch 1 and 16 from 136 against 8
new tokens of 32-token prompts. Sides (NAME=ENV as in ab_settings.py: another checkout through
PYTHONPATH, allocator or XLA settings) alternate within each round; every round is printed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from ab_settings import side_env  # benchmarks/ is the script's own path

# (name, prompt lengths per request, new tokens of the long run, of the short run, units per difference)
MEASURES = (("prefill tok/s", [1024], [64], 1, 960), ("decode b1 tok/s", [32], [32], (136, 8), 128),
            ("decode b16 tok/s", [32] * 16, [32] * 16, (136, 8), 16 * 128))


def cli_seconds(directory: str, env: dict, lengths: list[int], new: int) -> float:
    rng = np.random.default_rng(0)
    argv = [sys.executable, "-m", "moejax", "generate", "--hf", directory, "--max-new-tokens", str(new),
            "--ignore-eos", "--json"]
    for n in lengths:
        argv += ["--prompt-ids", ",".join(map(str, rng.integers(1, 32000, n)))]
    t = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True)
    return time.perf_counter() - t


def marginal(directory: str, env: dict, measure) -> float:
    _, long, short, new, units = measure
    new_long, new_short = new if isinstance(new, tuple) else (new, new)
    return units / (cli_seconds(directory, env, long, new_long) - cli_seconds(directory, env, short, new_short))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sides", nargs="+", help="NAME=ENV[,ENV...]")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from model_vs_transformers import hf_model

    sides = dict(side_env(s) for s in args.sides)
    with tempfile.TemporaryDirectory() as directory:
        hf_model(directory)
        for env in sides.values():  # warm the compile cache of every program the runs make
            for m in MEASURES:
                marginal(directory, env, m)
        print(f"{'round':<7}{'side':<16}" + "".join(f"{m[0]:>18}" for m in MEASURES) + "   load")
        for r in range(args.rounds):
            for name, env in sides.items():
                rates = [marginal(directory, env, m) for m in MEASURES]
                print(f"{r:<7}{name:<16}" + "".join(f"{v:>18.1f}" for v in rates) + f"   {os.getloadavg()[0]:.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
