"""The moejax engine of model_vs_transformers under several process settings, A/B in one run.

    python benchmarks/ab_settings.py [--rounds 4] [--decode-steps 32] [--smoke] NAME=ENV[,ENV...] ...

Each NAME is one worker process started with its own environment (e.g.
`malloc=MALLOC_ARENA_MAX=2,MALLOC_TRIM_THRESHOLD_=-1`, `plain=`, or another checkout through
`PYTHONPATH=...`; `AB_DECODE_BLOCK=N`: the engine's decode block): settings jax or glibc read
once, at start-up, cannot change inside one process. Every worker loads the same transformers directory as `moejax
generate --hf DIR` does; then the rounds alternate over the workers (a slow spell of the shared host lands on all
of them) and each round prints every worker's prefill tokens/s for one 512-token prompt and
decode tokens/s at batch 1 and 16. Each worker's first call (its first prefill, compile time
left out) and its peak RSS come first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

BATCHES = (1, 16)


def worker(directory: str, prompt_len: int, steps: int, vocab: int) -> None:
    """Answers each line on stdin with one JSON line of timings (seconds); the first line of
    output is its first call's prefill and its peak RSS."""
    from model_vs_transformers import moejax_engine

    engine = moejax_engine(directory)
    engine.decode_block = int(os.environ.get("AB_DECODE_BLOCK", engine.decode_block))  # this script's own knob
    rng = np.random.default_rng(0)
    long = [rng.integers(0, vocab, prompt_len).tolist()]
    shorts = [[rng.integers(0, vocab, 32).tolist() for _ in range(b)] for b in BATCHES]
    first = engine.generate(long, 1).prefill_ms / 1e3
    for short in shorts:  # compiles
        engine.generate(short, steps + 1)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"first_prefill": first, "peak_rss_mb": rss}), flush=True)
    for _ in sys.stdin:
        out = [engine.generate(long, 1).prefill_ms / 1e3]
        out += [engine.generate(s, steps + 1).decode_step_ms / 1e3 for s in shorts]
        print(json.dumps({"times": out}), flush=True)


def side_env(spec: str) -> tuple[str, dict]:
    name, _, assigns = spec.partition("=")
    env = dict(os.environ)
    for a in filter(None, assigns.split(",")):
        k, _, v = a.partition("=")
        env[k] = f"{v} {env.get(k, '')}".strip() if k == "XLA_FLAGS" else v
    return name, env


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sides", nargs="+", help="NAME=ENV[,ENV...]: one worker per side")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--smoke", action="store_true", help="a toy-width model, to check the script runs")
    args = ap.parse_args(argv)
    from model_vs_transformers import GEOMETRY, SMOKE, hf_model

    geometry = SMOKE if args.smoke else GEOMETRY

    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as directory:
        hf_model(directory, geometry)
        workers = {}
        print(f"{'side':<16}{'first prefill s':>16}{'peak RSS MB':>13}")
        for spec in args.sides:  # one at a time: their start-ups would share the cores
            name, env = side_env(spec)
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                directory,
                str(args.prompt_len),
                str(args.decode_steps),
                str(geometry["vocab_size"]),
            ]
            workers[name] = p = subprocess.Popen(
                cmd, cwd=here, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            first = json.loads(p.stdout.readline())
            print(f"{name:<16}{first['first_prefill']:>16.2f}{first['peak_rss_mb']:>13.0f}", flush=True)
        print(f"\n{'round':<7}{'side':<16}{'prefill tok/s':>14}{'b1 tok/s':>10}{'b16 tok/s':>11}   load")
        best = {name: [float("inf")] * 3 for name in workers}
        for r in range(args.rounds):
            for name, p in workers.items():
                time.sleep(1.0)  # the idle side's worker threads stop spinning
                p.stdin.write("go\n")
                p.stdin.flush()
                t = json.loads(p.stdout.readline())["times"]
                best[name] = list(map(min, best[name], t))
                print(
                    f"{r:<7}{name:<16}{args.prompt_len / t[0]:>14.0f}{1 / t[1]:>10.1f}{16 / t[2]:>11.1f}"
                    f"   {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
        print()
        for name, t in best.items():
            print(f"{'best':<7}{name:<16}{args.prompt_len / t[0]:>14.0f}{1 / t[1]:>10.1f}{16 / t[2]:>11.1f}")
        for p in workers.values():
            p.stdin.close()
            p.wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
