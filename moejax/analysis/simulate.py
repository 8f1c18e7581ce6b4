"""Decode-Anatomy's placement simulator: per step and MoE layer of a trace, each device's expert cost from
its local routes, the slowest device, summed over layers; per placement and expert order.

A decode step under placement P on N devices (mesh ep x tp) is modelled as

    step = non_moe + sum over MoE layers of ( exchange[P] + phase(c[d] for d in devices) )
    c[d] = base + per_route * routes[d] + per_expert * experts[d]      (costs.compute, per call shape)
    phase(c) = max(max_d c[d], sum_d c[d] / concurrency)

`routes[d]` are the picks device d computes, `experts[d]` the distinct experts (slices) it reads;
the coefficients belong to the call's shape (rows it runs, slice width, experts it holds), which is
what each placement changes. `phase` is the slowest device on hardware where all N run at once
(concurrency >= N); on a host with fewer cores than virtual devices the devices queue, and the
sum over cores bounds the phase instead. The exchange and non-MoE terms are measured per machine
(`costs.py`); they do not depend on routing here (XLA:CPU's all-to-all sends whole buffers).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from moejax.analysis import metrics
from moejax.analysis.analyze import FIT_FRACTION
from moejax.base.trace import Trace
from moejax.config import LayoutConfig
from sharding import eplb, registry


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str  # a placement (`sharding.registry`)
    ep: int  # expert groups
    tp: int  # slices of each expert's intermediate dimension

    @property
    def devices(self) -> int:
        return self.ep * self.tp

    @property
    def rows_stay_home(self) -> bool:
        """The placement's cost hook: rows stay on their device and meet every expert there."""
        return registry.placement_class(self.name).rows_stay_home


def layouts(n: int) -> list[Layout]:
    """Every registered placement on n devices, each on the mesh it takes by default (as
    `moejax compare` runs it)."""
    return [
        Layout(name, *cls.mesh_shape(LayoutConfig(placement=name, devices=n)))
        for name, cls in registry.REGISTRY.items()
    ]


@dataclasses.dataclass(frozen=True)
class Work:
    """What each device's local expert call runs in every step and layer."""

    rows: np.ndarray  # int[S]: rows of the call (the whole padded batch, or a device's own share)
    width: int  # intermediate width of each expert slice it holds
    held: int  # experts (slots) it holds
    routes: np.ndarray  # int[S, L, N]: picks it computes
    experts: np.ndarray  # int[S, L, N]: distinct experts it reads


def padded_rows(trace: Trace, n: int) -> np.ndarray:
    """int[S]: rows per step as the batch runs them: requests split over n devices (DP attention)."""
    return -(-trace.valid.sum(axis=1) // n) * n


def own_row_counts(trace: Trace, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(routes, experts) int[S, L, n] of each device's own rows (placements whose rows stay home)."""
    s, l = trace.ids.shape[:2]
    routes, experts = np.zeros((s, l, n), np.int64), np.zeros((s, l, n), np.int64)
    for step in range(s):
        ids = trace.step_ids(step)  # [L, R, k]
        home = metrics.own_devices(ids.shape[1], n)
        for d in range(n):
            mine = ids[:, home == d].reshape(l, -1)  # [L, picks]
            routes[step, :, d] = mine.shape[1]
            experts[step, :, d] = [len(np.unique(m)) for m in mine]
    return routes, experts


def device_work(trace: Trace, layout: Layout, phy2log: np.ndarray, intermediate: int) -> Work:
    """Each device's work under `layout` with experts ordered by phy2log int[L, P] (P slots over ep groups)."""
    n = layout.devices
    rows = padded_rows(trace, n)
    if layout.rows_stay_home:  # every expert gathered, own rows only
        routes, experts = own_row_counts(trace, n)
        return Work(rows // n, intermediate, trace.num_experts, routes, experts)
    # Every device of an ep group holds the group's experts, a 1/tp slice of each, and runs all
    # picks of them (rows that travel: those it received, in a buffer of the whole batch's size).
    counts = metrics.placement_counts(trace, phy2log, layout.ep)
    spread = lambda a: np.repeat(a, layout.tp, axis=-1)  # [S, L, ep] -> [S, L, N], ep-major as the mesh
    return Work(
        rows,
        intermediate // layout.tp,
        phy2log.shape[1] // layout.ep,
        spread(counts.device_picks),
        spread(counts.device_experts),
    )


def phase_us(call_us: np.ndarray, concurrency: int) -> np.ndarray:
    """float[S, L]: the layer's expert phase from per-device call times float[S, L, N]."""
    return np.maximum(call_us.max(axis=-1), call_us.sum(axis=-1) / concurrency)


def simulate(trace: Trace, layout: Layout, phy2log: np.ndarray, costs) -> dict:
    """Mean per-step times (ms) of `trace`'s steps under one layout and expert order. `costs` is a
    `costs.CostTable` (or anything with its `compute`, `exchange_us`, `non_moe_us`, `concurrency`)."""
    work = device_work(trace, layout, phy2log, costs.intermediate)
    call = np.zeros(work.routes.shape)
    for rows in np.unique(work.rows):
        steps = work.rows == rows
        base, per_route, per_expert = costs.compute(int(rows), work.width, work.held)
        call[steps] = base + per_route * work.routes[steps] + per_expert * work.experts[steps]
    phase = phase_us(call, costs.concurrency)  # [S, L]
    exchange = np.array([costs.exchange_us(layout, int(r)) for r in padded_rows(trace, layout.devices)])  # [S]
    moe = phase.sum(axis=1) + exchange * phase.shape[1]
    non_moe = np.array([costs.non_moe_us(layout.devices, int(r)) for r in padded_rows(trace, layout.devices)])
    mean_device = call.mean(axis=-1).sum(axis=1)  # [S]: the same work with no imbalance
    return {
        "step_ms": float((moe + non_moe).mean() / 1e3) if np.isfinite(non_moe).all() else None,
        "moe_ms": float(moe.mean() / 1e3),
        "expert_ms": float(phase.sum(axis=1).mean() / 1e3),
        "mean_device_expert_ms": float(mean_device.mean() / 1e3),
        # Decode-Anatomy's imbalance term: slowest device's expert time minus the mean device's, summed over layers.
        "imbalance_ms": float((phase.sum(axis=1) - mean_device).mean() / 1e3),
        "exchange_ms": float((exchange * phase.shape[1]).mean() / 1e3),
        "busiest_device_routes": float(work.routes.max(axis=-1).mean()),
        "mean_device_routes": float(work.routes.mean()),
    }


def rank_placements(trace: Trace, n: int, costs, placed: np.ndarray | None = None, spare_slots: int = 0) -> dict:
    """Every placement on n devices ranked by simulated MoE time per decode step, with contiguous
    expert order on all decode steps, and contiguous against EPLB (fitted on the first 60% of the
    steps, no spare slots: each device keeps E/ep experts) on the rest. `placed`: picks per
    expert float[L, E] of another trace (`--eplb`): also every decode step with the experts placed
    by EPLB on them with `spare_slots` replicas, as a run with that --eplb places them."""
    decode = trace.select((trace.kind == "decode") & (trace.valid.sum(axis=1) > 0))
    if not decode.num_steps:
        raise ValueError("the trace has no decode steps")
    num_layers, e = decode.ids.shape[1], decode.num_experts
    fit = math.ceil(FIT_FRACTION * decode.num_steps)
    test = decode.select(np.arange(fit, decode.num_steps))
    weight = metrics.expert_counts(decode.select(np.arange(fit))).sum(axis=0)  # [L, E]
    rows = []
    for layout in layouts(n):
        order = eplb.contiguous(num_layers, e)
        entry = {
            "placement": layout.name,
            "ep": layout.ep,
            "tp": layout.tp,
            "contiguous": simulate(decode, layout, order, costs),
        }
        if test.num_steps and layout.ep > 1 and not layout.rows_stay_home:
            fitted, _, _ = eplb.rebalance_experts(weight, e, 1, 1, layout.ep)
            entry["contiguous_test"] = simulate(test, layout, order, costs)
            entry["eplb_test"] = simulate(test, layout, fitted, costs)
        if placed is not None and layout.ep > 1 and not layout.rows_stay_home and (e + spare_slots) % layout.ep == 0:
            phy2log, _, _ = eplb.rebalance_experts(placed, e + spare_slots, 1, 1, layout.ep)
            entry["eplb_placed"] = simulate(decode, layout, phy2log, costs)
        rows.append(entry)
    rows.sort(key=lambda r: r["contiguous"]["moe_ms"])
    return {
        "devices": n,
        "steps": decode.num_steps,
        "fit_steps": fit,
        "test_steps": test.num_steps,
        "rows_per_step": float(decode.valid.sum(axis=1).mean()),
        "layers": num_layers,
        "ranking": [r["placement"] for r in rows],
        "placements": rows,
    }


def with_measured(report: dict, step_traces: list[dict]) -> dict:
    """`rank_placements`'s report with, per placement that a `moejax trace --json` report measured on the same
    devices and mesh, its measured step, MoE time (dispatch + experts + combine of the slowest device
    per layer), expert phase (slowest device per layer) and imbalance term ("measured"), beside the
    simulated ones."""
    entries = {r["placement"]: r for r in report["placements"]}
    for doc in step_traces:
        entry = entries.get(doc["placement"])
        if entry is None or doc["devices"] != report["devices"] or (doc["ep"], doc["tp"]) != (entry["ep"], entry["tp"]):
            raise ValueError(
                f"a step trace of {doc['placement']} {doc['ep']} x {doc['tp']} on {doc['devices']} devices "
                f"matches no placement advise simulates on {report['devices']} devices"
            )
        layers = doc["layers"]
        entry["measured"] = {
            "step_ms": doc["step_ms"],
            # The simulator's MoE time and expert phase are slowest-device figures per layer, summed.
            "moe_ms": sum(
                max(d["dispatch_ms"] + d["experts_ms"] + d["combine_ms"] for d in layer["devices"]) for layer in layers
            ),
            "expert_ms": sum(layer["slowest_ms"] for layer in layers),
            "imbalance_ms": doc["imbalance_ms"],
            "steps": doc["steps"],
            "routing": doc["routing"],
        }
    return report
