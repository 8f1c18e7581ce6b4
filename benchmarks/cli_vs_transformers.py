"""moejax's CLI against transformers' generate, as a user runs each: one process per command,
marginal costs, so that start-up, loading and compiling cancel out.

    python benchmarks/cli_vs_transformers.py [--rounds 2]

The model of `model_vs_transformers.py` (written once to a temporary directory). Each measure
runs a short and a long command on both sides and divides the difference in wall time by the
difference in work:
  decode batch 1 and 16: 32-token prompts, 136 against 8 new tokens -> seconds per step;
  prefill: one prompt of 1,024 against 64 tokens, one new token -> seconds per prompt token.
moejax runs `moejax generate --hf DIR --prompt-ids ... --max-new-tokens N --ignore-eos` with no
other flag (its compile cache warmed by a first run of each command); transformers runs
`AutoModelForCausalLM.from_pretrained(DIR)` and `generate` (greedy, exactly N new tokens) under
its fastest CPU expert implementation of `model_vs_transformers.py`, `grouped_mm`, on every core.
Sides alternate over rounds and each command keeps its fastest wall time; the ratio of the
marginals of the median walls is printed beside.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from model_vs_transformers import GEOMETRY, SMOKE, hf_model  # benchmarks/ is the script's own path

# measure -> (prompts, short (prompt tokens, new tokens), long (prompt tokens, new tokens))
MEASURES = {
    "prefill": (1, (64, 1), (1024, 1)),
    "decode b1": (1, (32, 8), (32, 136)),
    "decode b16": (16, (32, 8), (32, 136)),
}
SMOKE_MEASURES = {"decode b2": (2, (8, 2), (8, 6))}

HF_SCRIPT = """
import sys, torch, transformers
torch.set_num_threads({threads})
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
model.set_experts_implementation("grouped_mm")
ids = torch.tensor([[int(t) for t in p.split(",")] for p in sys.argv[3:]])
with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(sys.argv[2]),
                         min_new_tokens=int(sys.argv[2]), do_sample=False)
assert out.shape[1] == ids.shape[1] + int(sys.argv[2])
"""


def prompts(vocab: int, count: int, length: int) -> list[str]:
    rng = np.random.default_rng(length)
    return [",".join(map(str, rng.integers(0, vocab, length))) for _ in range(count)]


def commands(directory: str, vocab: int, count: int, prompt_len: int, new: int) -> dict[str, list[str]]:
    ps = prompts(vocab, count, prompt_len)
    return {
        "moejax": [
            "moejax",
            "generate",
            "--hf",
            directory,
            *(a for p in ps for a in ("--prompt-ids", p)),
            "--max-new-tokens",
            str(new),
            "--ignore-eos",
        ],
        "transformers": [sys.executable, "-c", HF_SCRIPT.format(threads=os.cpu_count()), directory, str(new), *ps],
    }


def wall(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; each command keeps its fastest")
    ap.add_argument(
        "--smoke", action="store_true", help="a toy-width model and short commands, to check the script runs"
    )
    args = ap.parse_args(argv)
    geometry, measures = (SMOKE, SMOKE_MEASURES) if args.smoke else (GEOMETRY, MEASURES)
    with tempfile.TemporaryDirectory() as directory:
        hf_model(directory, geometry)
        runs = {
            (m, length): commands(directory, geometry["vocab_size"], count, *shape)
            for m, (count, *shapes) in measures.items()
            for length, shape in zip(("short", "long"), shapes)
        }
        for cmds in runs.values() if not args.smoke else ():  # warm-up: moejax's compile cache, file caches
            for cmd in cmds.values():
                wall(cmd)
        walls = {(key, side): [] for key in runs for side in ("moejax", "transformers")}
        for _ in range(args.rounds):
            for side in ("transformers", "moejax"):
                for key, cmds in runs.items():
                    walls[key, side].append(wall(cmds[side]))
    print(
        f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; {args.rounds} "
        f"alternating rounds; transformers: grouped_mm experts, {os.cpu_count()} threads; moejax: "
        f"`moejax generate --hf DIR` defaults"
    )
    # The fastest walls are the measure; the medians' marginals beside them show how much one
    # process's luck moved it.
    print(f"{'measure (marginal)':<28}{'transformers':>14}{'moejax':>10}{'ratio':>8}{'of medians':>12}")
    for m, (_, (short_p, short_n), (long_p, long_n)) in measures.items():
        prefill = m == "prefill"
        work = (long_p - short_p) if prefill else (long_n - short_n)
        per = {
            (side, pick): (pick(walls[(m, "long"), side]) - pick(walls[(m, "short"), side])) / work
            for side in ("moejax", "transformers")
            for pick in (min, np.median)
        }
        unit = "ms per prompt token" if prefill else "ms per step"
        ratio = lambda pick: per["transformers", pick] / per["moejax", pick]
        print(
            f"{f'{m}, {unit}':<28}{per['transformers', min] * 1e3:>14.2f}{per['moejax', min] * 1e3:>10.2f}"
            f"{ratio(min):>8.2f}{ratio(np.median):>12.2f}"
        )
    # Every command's walls, so that a marginal can be checked against the spread it came from.
    print("wall seconds per round (a marginal is the difference of the fastest):")
    for (m, length), side in walls:
        print(f"  {m} {length} {side}: " + " ".join(f"{w:.2f}" for w in walls[(m, length), side]))


if __name__ == "__main__":
    main()
