"""Per-step, per-layer, per-device counts of a trace under one expert placement, and their summaries.

`placement_counts` is the one pass over a trace's picks; everything `analyze` reports, and what a
placement simulator needs (each device's picks, rows and distinct experts per step and layer), is
read off its `PlacementCounts`.

Dispatch rule for replicated experts: within one step and layer, the j-th pick of logical expert e
(rows in batch order, picks in rank order) goes to its replica j mod logcnt[e]. That is the most
even split of an expert's picks over its replicas; SGLang's static dispatch (prefer a replica on the
row's own device) is lumpier, so EPLB scores here are an upper bound for it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.base.trace import Trace
from sharding.eplb import logical_maps


@dataclasses.dataclass(frozen=True)
class PlacementCounts:
    device_picks: np.ndarray  # int[S, L, N]: picks each device serves (its local routes)
    device_rows: np.ndarray  # int[S, L, N]: rows with at least one pick on the device (rows it runs)
    device_experts: np.ndarray  # int[S, L, N]: distinct physical slots the device touches (weights it reads)
    copies: np.ndarray  # int[S, L]: rows sent to devices other than their own, summed over rows
    rows: np.ndarray  # int[S]: valid rows per step

    def select(self, steps: np.ndarray) -> PlacementCounts:
        """The counts of `steps` only (indices or a bool mask over S)."""
        return PlacementCounts(*(getattr(self, f.name)[steps] for f in dataclasses.fields(self)))


def own_devices(rows: int, n: int) -> np.ndarray:
    """int[rows]: the device each row starts on under DP attention: a contiguous block of the batch
    per device, as each device contributes its own requests' rows in order."""
    return np.arange(rows) * n // rows


def expert_counts(trace: Trace) -> np.ndarray:
    """int[S, L, E]: picks per logical expert in each step and layer (padding rows excluded)."""
    s, l = trace.ids.shape[:2]
    e = trace.num_experts
    mask = np.broadcast_to(trace.valid[:, None, :, None], trace.ids.shape)
    flat = (np.arange(s * l).reshape(s, l, 1, 1) * e + trace.ids)[mask]
    return np.bincount(flat, minlength=s * l * e).reshape(s, l, e)


def pick_slots(ids: np.ndarray, log2phy: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """int[L, R, k]: the physical slot each pick of one step goes to (dispatch rule in the module doc).

    ids int[L, R, k]; log2phy int[L, E, X]; logcnt int[L, E]."""
    num_layers, rows, k = ids.shape
    flat = ids.reshape(num_layers, rows * k)
    layer = np.arange(num_layers)[:, None]
    if logcnt.max() == 1:  # no replicas: no turns to deal
        return log2phy[layer, flat, 0].reshape(num_layers, rows, k)
    order = np.argsort(flat, axis=1, kind="stable")
    ordered = np.take_along_axis(flat, order, axis=1)
    position = np.broadcast_to(np.arange(rows * k), ordered.shape)
    first = np.ones_like(ordered, dtype=bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    rank_ordered = position - np.maximum.accumulate(np.where(first, position, 0), axis=1)
    rank = np.empty_like(rank_ordered)
    np.put_along_axis(rank, order, rank_ordered, axis=1)
    replica = rank % logcnt[layer, flat]
    return log2phy[layer, flat, replica].reshape(num_layers, rows, k)


def placement_counts(trace: Trace, phy2log: np.ndarray, n: int) -> PlacementCounts:
    """Counts of every step of `trace` with experts placed by phy2log int[L, P] on n devices."""
    num_layers, num_slots = phy2log.shape
    if num_slots % n:
        raise ValueError(f"{num_slots} physical slots do not split over {n} devices")
    per_device = num_slots // n
    log2phy, logcnt = logical_maps(phy2log, trace.num_experts)
    shape = (trace.num_steps, num_layers, n)
    picks, rows_on, experts = np.zeros(shape, np.int64), np.zeros(shape, np.int64), np.zeros(shape, np.int64)
    copies = np.zeros(shape[:2], np.int64)
    layer = np.arange(num_layers)[:, None]
    for s in range(trace.num_steps):
        slots = pick_slots(trace.step_ids(s), log2phy, logcnt)  # [L, R, k]
        rows = slots.shape[1]
        device = slots // per_device
        flat_device = (layer * n + device.reshape(num_layers, -1)).ravel()
        picks[s] = np.bincount(flat_device, minlength=num_layers * n).reshape(num_layers, n)
        visits = np.zeros((num_layers, rows, n), dtype=bool)  # [L, R, N]: row r needs device d
        np.put_along_axis(visits, device, True, axis=2)
        rows_on[s] = visits.sum(axis=1)
        own = visits[:, np.arange(rows), own_devices(rows, n)]  # [L, R]
        copies[s] = visits.sum(axis=(1, 2)) - own.sum(axis=1)
        read = np.zeros((num_layers, num_slots), dtype=bool)
        np.put_along_axis(read, slots.reshape(num_layers, -1), True, axis=1)
        experts[s] = read.reshape(num_layers, n, per_device).sum(axis=-1)
    return PlacementCounts(picks, rows_on, experts, copies, trace.valid.sum(axis=1))


def balancedness(per_device: np.ndarray) -> np.ndarray:
    """float[...]: SGLang's balancedness, mean over devices / max over devices (last axis)."""
    return per_device.mean(axis=-1) / per_device.max(axis=-1)


def score(counts: PlacementCounts, bytes_per_expert: float) -> dict:
    """Averages over steps and layers of one placement's counts (the `analyze` JSON per placement)."""
    rows = counts.rows[:, None]  # [S, 1]
    return {
        "balancedness": float(balancedness(counts.device_picks).mean()),
        "busiest_device_picks": float(counts.device_picks.max(axis=-1).mean()),
        "mean_device_picks": float(counts.device_picks.mean()),
        "devices_per_row": float((counts.device_rows.sum(axis=-1) / rows).mean()),
        "copies_per_row": float((counts.copies / rows).mean()),
        "expert_bytes_read_per_device": float(counts.device_experts.mean() * bytes_per_expert),
        "busiest_device_expert_bytes": float(counts.device_experts.max(axis=-1).mean() * bytes_per_expert),
        "bytes_balancedness": float(balancedness(counts.device_experts).mean()),
    }


def touched_fraction(counts: np.ndarray) -> np.ndarray:
    """float[S, L]: fraction of experts with at least one pick, from expert_counts int[S, L, E]."""
    return (counts > 0).mean(axis=-1)


def busiest_expert_vs_mean(counts: np.ndarray) -> np.ndarray:
    """float[L]: each layer's busiest expert over all steps against the mean expert (Figure 12 left)."""
    total = counts.sum(axis=0)  # [L, E]
    return total.max(axis=-1) / total.mean(axis=-1)
