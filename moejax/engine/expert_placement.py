"""A run's expert placement: at load, from a recorded trace (`layout.eplb`) or the checkpoint
order with spare replicas; the counts it is computed from; the slots' per-device rows.

DeepSeek's EPLB (`sharding/eplb.py`, global policy over the ep devices) turns picks per logical
expert into phy2log int[L, P]; `sharding/moves.py` moves the experts there.
"""

from __future__ import annotations

import numpy as np

from moejax.base.errors import UsageError
from sharding import eplb, moves, slots


def wants_slots(layout) -> bool:
    """Whether a run keeps its experts in placement slots (else the checkpoint order, untouched)."""
    return bool(layout.redundant_experts or layout.eplb or layout.eplb_online)


def moe_layers(c) -> int:
    return c.num_layers - len(c.dense_layers)


def trace_counts(trace, c, num_logical: int) -> np.ndarray:
    """float[L, E_padded]: picks per logical expert over a trace's valid rows, checked against the model."""
    layers = moe_layers(c)
    if trace.num_experts != c.num_experts or trace.ids.shape[1] != layers:
        raise UsageError(
            f"--eplb: the trace has {trace.ids.shape[1]} MoE layers of {trace.num_experts} experts; "
            f"this model has {layers} of {c.num_experts}"
        )
    counts = np.zeros((layers, num_logical))
    for l in range(layers):
        picked = trace.ids[:, l][np.broadcast_to(trace.valid[..., None], trace.ids[:, l].shape)]
        counts[l] = np.bincount(picked, minlength=num_logical)
    return counts


def balanced(counts: np.ndarray, placement) -> np.ndarray:
    """int[L, P]: EPLB's placement of picks per expert counts float[L, E] over the ep devices."""
    phy2log, _, _ = eplb.rebalance_experts(counts, placement.num_experts, 1, 1, placement.ep)
    return phy2log


def initial_phy2log(placement, load_trace) -> np.ndarray:
    """int[L, P]: from the layout's trace (`load_trace(path)`), else the checkpoint order plus replicas."""
    c, layout = placement.config.model, placement.config.layout
    if layout.eplb:
        return balanced(trace_counts(load_trace(layout.eplb), c, placement.num_logical), placement)
    return slots.default_phy2log(moe_layers(c), placement.num_logical, placement.num_experts)


def place_experts(params: dict, placement, load_trace, loops: tuple | None = None) -> tuple[dict, np.ndarray]:
    """Loaded params (experts in checkpoint order; each run held by its loop of `loops`, default
    stacked) -> (params with the experts in the layout's placement and its slot tables, that
    phy2log); unchanged without expert placement."""
    layout = placement.config.layout
    if not wants_slots(layout):
        return params, None
    phy2log = initial_phy2log(placement, load_trace)
    order = eplb.contiguous(phy2log.shape[0], placement.num_logical)
    params, _ = moves.arrange(placement, params, order, phy2log, loops)
    return params, phy2log


def trace_device_rows(trace, phy2log: np.ndarray | None, placement) -> np.ndarray:
    """int[N]: rows each ep device's experts computed over every pass of `trace`, summed over
    MoE layers, with the experts placed by `phy2log` (None: checkpoint order)."""
    return sum(
        (
            slots.device_rows(
                trace.ids[s], trace.valid[s], phy2log, placement.num_logical, placement.ep, placement.home_replicas
            )
            for s in range(trace.num_steps)
        ),
        np.zeros(placement.ep, np.int64),
    )
