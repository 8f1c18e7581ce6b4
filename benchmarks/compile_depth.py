"""Compile time and peak memory against model depth, per placement: the layer scan's claim.

    python benchmarks/compile_depth.py [--layers 4,16,78] [--placements all] [--devices 8]

Each cell is one fresh `moejax generate` process (tiny preset width, the given number of
layers, 4 new tokens, no persistent compile cache): its wall time, the compile seconds it
reports (`timing.compile_s`) and its peak resident memory. With the layers under `lax.scan`,
compile time does not grow with depth; wall time and memory still grow with the parameters
(78 layers hold 20 times the weights of 4, made and placed at start).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

from moejax.config import PRESETS


def run(layers: int, placement: str, devices: int) -> tuple[float, float, float]:
    """(wall seconds, compile seconds, peak RSS in GB) of one generate run of a `layers`-deep
    tiny model; compile seconds are generate's own `timing.compile_s`."""
    model = dataclasses.asdict(dataclasses.replace(PRESETS["tiny"], num_layers=layers))
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "model.json")
        with open(config, "w") as f:
            json.dump({"model": model}, f)
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.join(tmp, "xla"))  # cold: nothing compiled before
        argv = [
            sys.executable,
            "-m",
            "moejax",
            "generate",
            "--config",
            config,
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "4",
            "--json",
        ]
        if devices > 1:
            argv += ["--devices", str(devices), "--placement", placement]
        t0 = time.perf_counter()
        child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        out = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS (KiB on Linux)
        if status:
            raise SystemExit(f"{' '.join(argv)} failed ({status})")
        return time.perf_counter() - t0, json.loads(out)["timing"]["compile_s"], usage.ru_maxrss / 1e6


def main(argv: list[str] | None = None) -> None:
    from sharding import names

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="4,16,78")
    p.add_argument("--placements", default="all")
    p.add_argument("--devices", type=int, default=8)
    args = p.parse_args(argv)
    depths = [int(x) for x in args.layers.split(",")]
    placements = list(names()) if args.placements == "all" else args.placements.split(",")
    print(f"tiny preset width, {args.devices} devices, generate 4 new tokens, cold compile cache")
    print("each cell: wall s / compile s / peak RSS GB; the ratio: compile s, deepest over shallowest")
    print(f"{'placement':<16}" + "".join(f"{f'{d} layers':>22}" for d in depths) + f"{'compile ratio':>15}")
    for name in placements:
        cells = [run(d, name, args.devices) for d in depths]
        print(
            f"{name:<16}"
            + "".join(f"{f'{s:.1f} / {c:.1f} / {gb:.2f}':>22}" for s, c, gb in cells)
            + f"{cells[-1][1] / cells[0][1]:>14.2f}x"
        )


if __name__ == "__main__":
    main()
