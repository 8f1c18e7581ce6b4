"""Simulated against measured decode step time per placement on the 8-device CPU mesh.

    python benchmarks/simulator_validation.py [--preset tiny] [--steps 16] [--costs FILE] [--out DIR]

1. Calibration (other prompts than the validation's): the cost table's compute and exchange
   entries (`moejax.analysis.costs.ensure`), and the non-MoE term, fitted once from the default
   placement's measured step (measured minus its simulated MoE part).
2. Validation on `moejax compare`'s default prompts: each placement's decode step as `compare`
   measures it (`moejax.verbs.compare.measure`, best of REPEATS runs), against the simulation of the
   trace recorded from the same prompts. Prints the table and the error per placement (target: within 25%).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

DEVICES = 8
CALIBRATION_PROMPTS = [[(11 * r + 5 * i) % 89 + 2 for i in range(6 + 2 * r)] for r in range(DEVICES)]
REPEATS = 7  # measured steps: the best of this many timed runs each


def best_steps_ms(runs: dict, steps: int, repeats: int = REPEATS) -> dict:
    """{name: best decode step ms} of runs {name: (engine, prompts)}, timed round-robin so that the
    shared host's load falls on every run alike (the cost table's timings are best-of too)."""
    from moejax.verbs.compare import measure

    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, (engine, prompts) in runs.items():
            best[name] = min(best[name], measure(engine, prompts, steps + 1)["decode_step_ms"])
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=16, help="decode steps measured and simulated")
    parser.add_argument("--costs", default=str(Path.home() / ".cache/moejax/costs-validation.json"))
    parser.add_argument("--out", default="/tmp/moejax-validation", help="directory for the two recorded traces")
    parser.add_argument("--devices", type=int, default=DEVICES, help="CPU devices of the mesh")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed runs per measured step (the best is kept)")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/moejax/xla"))

    from moejax.analysis import costs
    from moejax.analysis.record import model_trace
    from moejax.analysis.simulate import layouts, simulate
    from moejax.base.trace import save_trace
    from moejax.config import Config, preset
    from moejax.launch.factory import build_engine, ensure_devices
    from moejax.launch.flags import DEFAULT_PROMPTS
    from sharding import eplb, registry, with_placement

    ensure_devices(args.devices)
    config = dataclasses.replace(Config(), model=preset(args.preset))
    engine_of = lambda name: build_engine(with_placement(config, name, args.devices), None, 0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    by_name = {layout.name: layout for layout in layouts(args.devices)}

    engines = {layout.name: engine_of(layout.name) for layout in layouts(args.devices)}
    fit_engine = engines[registry.DEFAULT]
    calibration = save_trace(
        out / "calibration.npz", **model_trace(fit_engine, CALIBRATION_PROMPTS, args.steps, args.preset)
    )
    trace = save_trace(out / "validation.npz", **model_trace(fit_engine, DEFAULT_PROMPTS, args.steps, args.preset))
    table = costs.load(Path(args.costs), config)
    costs.ensure(table, config, calibration, args.devices)
    costs.ensure(table, config, trace, args.devices)  # same shapes as calibration: nothing new to measure
    runs = {"fit": (fit_engine, CALIBRATION_PROMPTS), **{name: (e, DEFAULT_PROMPTS) for name, e in engines.items()}}
    measured = best_steps_ms(runs, args.steps, args.repeats)
    non_moe = costs.fit_non_moe(table, measured["fit"], calibration, by_name[registry.DEFAULT])
    costs.save(table, Path(args.costs))

    decode = trace.select(trace.kind == "decode")
    order = eplb.contiguous(decode.ids.shape[1], decode.num_experts)
    print(
        f"{args.preset}, {len(DEFAULT_PROMPTS)} requests, {args.steps} decode steps, {args.devices} CPU devices "
        f"({table.concurrency} cores); non-MoE {non_moe / 1e3:.2f} ms/step fitted on {registry.DEFAULT} "
        f"with other prompts"
    )
    print(f"{'placement':<16}{'ep x tp':>8}{'exchange':>10}{'experts':>9}{'simulated':>11}{'measured':>10}{'error':>8}")
    errors = []
    for layout in layouts(args.devices):
        sim = simulate(decode, layout, order, table)
        error = sim["step_ms"] / measured[layout.name] - 1
        errors.append(abs(error))
        print(
            f"{layout.name:<16}{layout.ep:>4} x {layout.tp:<2}{sim['exchange_ms']:>10.2f}{sim['expert_ms']:>9.2f}"
            f"{sim['step_ms']:>11.2f}{measured[layout.name]:>10.2f}{error:>+8.1%}"
        )
    print(f"largest error {max(errors):.1%} (target 25%); times in ms per decode step")


if __name__ == "__main__":
    main()
