"""Row-Meets-Experts' figures (docs/references.md) beside what `moejax calc` and `moejax analyze` (on the synthetic
glm-like trace) give.

    PYTHONPATH=. python benchmarks/row_meets_experts.py [--steps 300] [--seed 0]   # from the repository root

Prints one line per figure: what it is, Row-Meets-Experts' value, ours. About 30 s on one CPU core.
"""

from __future__ import annotations

import argparse

from moejax.analysis import analyze, calc, synthetic
from moejax.base.trace import Trace
from moejax.config import preset


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    glm = preset("glm-5.3")
    c = calc.calc_report(glm, [8, 16, 32], tokens=64, touched=188, expert_format="nvfp4")
    cd = {d["n"]: d for d in c["devices"]}
    trace = Trace(**synthetic.generate(synthetic.GLM_LIKE, args.steps, 64, args.seed))
    a = analyze.analyze(trace, [8, 16, 32], glm, "glm-5.3", "nvfp4", 32)["kinds"]["decode"]
    ad = {d["n"]: d for d in a["devices"]}
    rows = [
        ("parameters per expert (M)", 37.7, c["expert_params"] / 1e6),
        ("expert, 4-bit values (MB)", 18.9, c["expert_bytes"]["nvfp4_values"] / 1e6),
        ("expert, NVFP4 with scales (MB)", 21, c["expert_bytes"]["nvfp4"] / 1e6),
        ("layer, 4-bit values (GB)", 4.83, c["layer_expert_bytes"]["nvfp4_values"] / 1e9),
        ("layer, NVFP4 with scales (GB)", 5.4, c["layer_expert_bytes"]["nvfp4"] / 1e9),
        ("75 MoE layers, 4-bit values (GB)", 362, c["model_expert_bytes"]["nvfp4_values"] / 1e9),
        ("row bf16 / nvfp4 (B)", "12,288 / 3,456", f"{c['row_bytes']['bf16']:,} / {c['row_bytes']['nvfp4']:,}"),
        ("devices per row, 8 devices", 5.3, cd[8]["devices_per_row"]),
        ("even-router touched at 64 tokens", 0.87, cd[8]["even_touched_fraction"]),
        (
            "188 touched experts, GB per device on 8 / 32",
            "0.50 / 0.125",
            f"{cd[8]['expert_bytes_read_per_device'] / 1e9:.3f} / {cd[32]['expert_bytes_read_per_device'] / 1e9:.3f}",
        ),
        ("synthetic: experts touched per step", 0.72, a["experts_touched"]["trace"]),
        ("synthetic: busiest expert per step (picks of 512)", 17, a["picks_per_expert"]["busiest_per_step"]),
        (
            "synthetic: busiest expert vs mean, min-max over layers",
            "2.9-14",
            f"{a['busiest_expert_vs_mean']['min']:.1f}-{a['busiest_expert_vs_mean']['max']:.1f}",
        ),
        ("synthetic: copies per row, 8 devices", 4.6, ad[8]["contiguous"]["copies_per_row"]),
    ]
    for n, copies, bal, eplb_bal, even in (
        (8, 4.6, 0.75, 0.86, 0.85),
        (16, 6.1, 0.61, 0.78, 0.76),
        (32, 7.0, 0.46, 0.67, 0.65),
    ):
        rows += [
            (f"copies sent per row, {n} devices (even router)", copies, cd[n]["copies_sent_per_row"]),
            (f"even-router balancedness, {n} devices", even, cd[n]["even_balancedness"]),
            (f"synthetic: balancedness, contiguous, {n} devices", bal, ad[n]["contiguous"]["balancedness"]),
            (
                f"synthetic: balancedness, EPLB 32 spare slots, {n} devices",
                eplb_bal,
                ad[n]["eplb_test"]["balancedness"],
            ),
        ]
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'published':>14}  {'moejax':>14}")
    for name, article, ours in rows:
        ours = f"{ours:.3f}" if isinstance(ours, float) else str(ours)
        print(f"{name:<{width}}  {str(article):>14}  {ours:>14}")


if __name__ == "__main__":
    main()
