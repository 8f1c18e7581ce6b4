"""The `moejax analyze` report: a trace's skew and balance per device count, beside an even router
and beside EPLB placements fitted on the first 60% of the steps and scored on the rest.

Steps of different kinds (decode, prefill) are reported apart: their batch sizes differ by orders
of magnitude, and so do their statistics.
"""

from __future__ import annotations

import math

import numpy as np

from moejax.analysis import calc, metrics
from moejax.base.errors import UsageError
from moejax.base.trace import Trace
from moejax.config import ModelConfig
from sharding import eplb

FIT_FRACTION = 0.6  # steps EPLB is fitted on; it is scored on the remaining ones


def check_devices(num_experts: int, devices: list[int], spare_slots: int) -> None:
    for n in devices:
        if n < 1 or num_experts % n or (num_experts + spare_slots) % n:
            raise UsageError(
                f"{n} devices do not divide {num_experts} experts and {num_experts + spare_slots} "
                f"EPLB slots evenly; choose device counts that divide both"
            )


def even_router(num_experts: int, k: int, n: int, rows: int, bytes_per_expert: float) -> dict:
    """The closed-form/Monte Carlo figures of an even router for one device count and batch size."""
    balance, busiest = calc.even_balance(num_experts, k, n, rows)
    touched = calc.even_touched_fraction(num_experts, k, rows) * num_experts
    return {
        "balancedness": balance,
        "busiest_device_picks": busiest,
        "devices_per_row": calc.devices_per_row(num_experts, k, n),
        "copies_per_row": calc.copies_sent_per_row(num_experts, k, n),
        "expert_bytes_read_per_device": touched * bytes_per_expert / n,
    }


def _example(counts: np.ndarray, contiguous: metrics.PlacementCounts) -> dict:
    """Figure 12's data: picks per expert over all steps of the middle layer, and picks per device
    in that layer's step of median balancedness (a typical step)."""
    layer = counts.shape[1] // 2
    per_step = metrics.balancedness(contiguous.device_picks[:, layer])  # [S]
    step = int(np.argsort(per_step, kind="stable")[len(per_step) // 2])
    return {
        "layer": layer,
        "expert_picks": counts[:, layer].sum(axis=0).tolist(),
        "step": step,
        "n": contiguous.device_picks.shape[-1],
        "device_picks": contiguous.device_picks[step, layer].tolist(),
    }


def analyze_kind(trace: Trace, devices: list[int], bytes_per_expert: float, spare_slots: int) -> dict:
    """The report of the steps of one kind."""
    e, k = trace.num_experts, trace.k
    num_layers = trace.ids.shape[1]
    counts = metrics.expert_counts(trace)  # [S, L, E]
    steps = trace.num_steps
    rows = int(round(trace.valid.sum(axis=1).mean()))  # the even router's batch size
    fit = math.ceil(FIT_FRACTION * steps)
    test = np.arange(fit, steps)
    test_trace = trace.select(test)
    fitted = counts[:fit].sum(axis=0).astype(np.float64)  # [L, E] picks per expert over the fit steps
    touch_prob = (counts[:fit] > 0).mean(axis=0)  # [L, E] share of fit steps touching each expert
    ratio = metrics.busiest_expert_vs_mean(counts)
    touched = metrics.touched_fraction(counts)  # [S, L]
    report = {
        "steps": steps,
        "fit_steps": fit,
        "test_steps": len(test),
        "rows_per_step": float(trace.valid.sum(axis=1).mean()),
        "experts_touched": {"trace": float(touched.mean()), "even": calc.even_touched_fraction(e, k, rows)},
        "picks_per_expert": {"mean": rows * k / e, "busiest_per_step": float(counts.max(axis=-1).mean())},
        "busiest_expert_vs_mean": {
            "min": float(ratio.min()),
            "median": float(np.median(ratio)),
            "max": float(ratio.max()),
        },
        "per_layer": {
            "layer": trace.layers.tolist(),
            "touched_fraction": touched.mean(axis=0).tolist(),
            "busiest_expert_vs_mean": ratio.tolist(),
            "balancedness": {},
        },
        "devices": [],
    }
    for n in devices:
        contiguous = metrics.placement_counts(trace, eplb.contiguous(num_layers, e), n)
        report["per_layer"]["balancedness"][str(n)] = (
            metrics.balancedness(contiguous.device_picks).mean(axis=0).tolist()
        )
        entry = {
            "n": n,
            "even": even_router(e, k, n, rows, bytes_per_expert),
            "contiguous": metrics.score(contiguous, bytes_per_expert),
        }
        if len(test):
            # One node of n devices: the global policy (groups only matter across nodes).
            picks_placement, _, _ = eplb.rebalance_experts(fitted, e + spare_slots, 1, 1, n)
            bytes_placement, _, _ = eplb.rebalance_for_bytes(touch_prob, n)
            entry["contiguous_test"] = metrics.score(contiguous.select(test), bytes_per_expert)
            entry["eplb_test"] = metrics.score(
                metrics.placement_counts(test_trace, picks_placement, n), bytes_per_expert
            )
            entry["eplb_bytes_test"] = metrics.score(
                metrics.placement_counts(test_trace, bytes_placement, n), bytes_per_expert
            )
        report["devices"].append(entry)
        if n == devices[0]:
            report["example"] = _example(counts, contiguous)
    return report


def analyze(
    trace: Trace, devices: list[int], geometry: ModelConfig, geometry_name: str, expert_format: str, spare_slots: int
) -> dict:
    """The `moejax analyze --json` document."""
    if geometry.num_experts != trace.num_experts:
        raise UsageError(
            f"the trace has {trace.num_experts} experts but preset {geometry_name!r} has "
            f"{geometry.num_experts}; pass the trace's model with --preset"
        )
    check_devices(trace.num_experts, devices, spare_slots)
    bytes_per_expert = calc.expert_bytes(geometry)[expert_format]
    kinds = {}
    for kind in dict.fromkeys(trace.kind.tolist()):  # kinds in order of first appearance
        steps = (trace.kind == kind) & (trace.valid.sum(axis=1) > 0)
        if steps.any():
            kinds[kind] = analyze_kind(trace.select(steps), devices, bytes_per_expert, spare_slots)
    return {
        "trace": {
            "model": trace.model,
            "num_experts": trace.num_experts,
            "k": trace.k,
            "layers": int(trace.ids.shape[1]),
            "steps": int(trace.num_steps),
        },
        "geometry": {"preset": geometry_name, "expert_format": expert_format, "expert_bytes": bytes_per_expert},
        "eplb": {"spare_slots": spare_slots, "fit_fraction": FIT_FRACTION, "policy": "global"},
        "kinds": kinds,
    }
