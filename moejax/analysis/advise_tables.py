"""What `advise` prints: the table of its report on this machine's measured costs, and the table
and JSON of its ranking on a target (`target_ranking`)."""

from __future__ import annotations

import dataclasses

from moejax.analysis.target_pricing import CATEGORIES
from moejax.analysis.target_ranking import TargetRanking

# The target's figures a ranking's report carries.
TARGET_FIGURES = (
    "name",
    "device_kind",
    "hbm_gb",
    "hbm_tb_s",
    "bf16_tflops",
    "fp4_tflops",
    "link_gb_s",
    "launch_us",
    "collective_us",
)


def measured_table(report: dict) -> str:
    """`advise --target cpu`'s report (`costs.measure_and_rank`) as a table."""
    lines = [
        f"{report['steps']} decode steps of {report['rows_per_step']:.0f} rows, {report['layers']} MoE layers, "
        f"{report['devices']} devices; costs of {report['costs']}",
        "placement        ep x tp  step ms   MoE ms  experts ms  imbalance ms  exchange ms  busiest/mean routes  "
        "EPLB test (contiguous test) MoE ms",
    ]
    for r in report["placements"]:
        s = r["contiguous"]
        step = f"{s['step_ms']:7.2f}" if s["step_ms"] is not None else "      -"
        eplb_ms = f"{r['eplb_test']['moe_ms']:.2f} ({r['contiguous_test']['moe_ms']:.2f})" if "eplb_test" in r else "-"
        lines.append(
            f"{r['placement']:<16} {r['ep']:>3} x {r['tp']:<2} {step}  {s['moe_ms']:7.2f}"
            f"  {s['expert_ms']:10.2f}  {s['imbalance_ms']:12.2f}"
            f"  {s['exchange_ms']:11.2f}  {s['busiest_device_routes']:8.1f} / {s['mean_device_routes']:<8.1f}"
            f"  {eplb_ms}"
        )
    for r in report["placements"]:
        if "eplb_placed" in r:
            lines.append(
                f"{r['placement']}: experts placed by --eplb, MoE {r['eplb_placed']['moe_ms']:.2f} ms per decode "
                f"step (contiguous {r['contiguous']['moe_ms']:.2f})"
            )
    lines.append(f"fastest: {report['ranking'][0]}")
    measured = [r for r in report["placements"] if "measured" in r]
    if measured:
        lines.append("simulated / traced (moejax trace), ms per decode step")
        lines.append(
            f"{'placement':<16} {'step':^15}"
            + "".join(f"  {h:^13}" for h in ("MoE", "experts", "imbalance"))
            + "  traced routing"
        )
        for r in measured:
            s, m = r["contiguous"], r["measured"]
            step = f"{s['step_ms']:.2f}" if s["step_ms"] is not None else "-"
            lines.append(
                f"{r['placement']:<16} {step:>6} / {m['step_ms']:<6.2f}"
                + "".join(f"  {s[k]:>5.2f} / {m[k]:<5.2f}" for k in ("moe_ms", "expert_ms", "imbalance_ms"))
                + f"  {m['routing']}"
            )
    return "\n".join(lines)


def _json(value):
    """A ranking's parts as JSON values: each dataclass an object of its fields, less the optional
    ones left unset (a `Lead` carries `part_us` or `part_gb`)."""
    if dataclasses.is_dataclass(value):
        return {
            f.name: _json(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not (f.default is None and getattr(value, f.name) is None)
        }
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_json(v) for v in value]
    return value


def target_json(model: str, ranking: TargetRanking) -> dict:
    """`advise --target --json`: the ranking, with the target's figures it was priced at."""
    figures = {k: v for k, v in dataclasses.asdict(ranking.target).items() if k in TARGET_FIGURES}
    return {"model": model, **_json(ranking), "target": figures}


def target_table(model: str, ranking: TargetRanking) -> str:
    t = ranking.target
    lines = [
        f"{model} on {ranking.devices} {t.name} ({t.device_kind}): decode {ranking.batch} rows "
        f"over {ranking.context} positions, prefill chunks of {ranking.prefill_chunk} tokens; HBM "
        f"{t.hbm_tb_s} TB/s, bf16 {t.bf16_tflops:g} TFLOPS, links {t.link_gb_s:g} GB/s, "
        f"{t.launch_us:g} us per kernel, {t.collective_us:g} us per collective"
    ]
    for phase, p in ranking.phases.items():
        lines.append(
            f"\n{phase} ({p.steps} steps of {p.rows} rows), us per call; a layer's share of its kernels, "
            "collectives and MB moved a device"
        )
        lines.append(
            f"{'layout':<18}{'step':>9}"
            + "".join(f"{c:>11}" for c in CATEGORIES)
            + f"{'GB/device':>11}{'kernels/layer':>15}{'coll/layer':>12}{'MB/layer':>10}"
        )
        for r in p.layouts:
            lines.append(
                f"{r.layout:<18}{r.us.step:>9.1f}"
                + "".join(f"{getattr(r.us, c):>11.1f}" for c in CATEGORIES)
                + f"{r.memory_gb:>11.1f}{r.layer.kernels:>15.1f}{r.layer.collectives:>12.1f}{r.layer.gb * 1e3:>10.1f}"
                + ("" if r.fits else "  does not fit")
            )
        d = p.decides
        if d and d.part == "memory":
            lines.append(
                f"{d.first} leads {d.second}, {-d.lead_us:.1f} us slower, by fitting "
                f"{t.hbm_gb:g} GB: {d.part_gb:.1f} GB a device less"
            )
        elif d:
            lines.append(f"{d.first} leads {d.second} by {d.lead_us:.1f} us: {d.part} {d.part_us:.1f} us less")
    for skipped in ranking.not_compiled:
        lines.append(f"{skipped.layout}: {skipped.error}")
    r = ranking.recommend
    why = f" (apart: prefill {r.apart_saves_us:.1f} us faster per chunk than under {r.decode})" if r.apart else ""
    lines.append(
        f"\nrecommend: serve {r.flags}{why}; predicted decode step {r.decode_us:.1f} us, "
        f"prefill chunk {r.prefill_us:.1f} us" + ("" if r.fits else f"; but no layout fits {t.hbm_gb:g} GB per device")
    )
    return "\n".join(lines)
