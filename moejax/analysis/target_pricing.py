"""A compiled layout's call priced on the target, op by op of its optimized HLO:

    kernel      max(bytes / HBM bandwidth, flops / peak) + the target's launch cost
    collective  bytes each device sends / link bandwidth + the target's collective latency

Two parts of a step depend on routing; the trace sets them per step and MoE layer, and the
busiest device sets the step (as `simulate.py` does for the CPU's measured table):
  * the experts. A compiled program reads every local expert; a device reads those its rows
    touch. Per layer and device: max((other bytes + touched experts x bytes per expert) / HBM
    bandwidth, 2 x routes x parameters per expert / peak), plus the expert kernels' launches;
    the other bytes are the expert kernels' bytes less every local expert's.
  * a ragged all-to-all, compiled for every row going to every device: its bytes scale by the
    rows the busiest device really sends or receives (experts in contiguous order).

Ignored: overlap (async collectives and prefetches run beside compute; here every op adds),
contention (collectives sharing links, kernels sharing HBM), caches (every operand comes from
HBM), and launches a CUDA graph hides.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.analysis import calc, hlo_ops, metrics
from moejax.analysis.simulate import device_work
from moejax.analysis.target_programs import Candidate
from moejax.base.targets import Target
from moejax.base.trace import Trace
from moejax.config import ModelConfig
from sharding import eplb

CATEGORIES = ("attention", "experts", "exchange", "rest")
# Collectives of the MoE block's exchange: its scope, and weight_prefetch's expert gather (an
# all_gather to "invarying", outside it). A ragged all-to-all carries no scope; only exchanges run one.
EXCHANGE_SCOPES = ("moe/", "all_gather_invariant")


@dataclasses.dataclass(frozen=True)
class CallTime:
    """Microseconds of one call of a program: in all (`step`), and per part of it (CATEGORIES)."""

    step: float
    attention: float
    experts: float
    exchange: float
    rest: float

    @classmethod
    def of(cls, parts: dict[str, float]) -> CallTime:
        return cls(sum(parts.values()), **parts)


def category(op: hlo_ops.Op) -> str:
    """attention, experts (the local expert kernels), exchange (the exchange's collectives, and the
    kernels packing rows for them and summing what comes back: the placement's shard_map), rest."""
    if op.kind == "kernel":
        if "/experts/" in op.scope:
            return "experts"
        if "moe/shard_map/" in op.scope:
            return "exchange"
    elif op.kind == "ragged-all-to-all" or any(s in op.scope for s in EXCHANGE_SCOPES):
        return "exchange"
    return "attention" if "attention" in op.scope else "rest"


def op_us(op: hlo_ops.Op, t: Target) -> float:
    if op.kind == "kernel":
        return max(op.bytes / (t.hbm_tb_s * 1e6), op.flops / (t.bf16_tflops * 1e6)) + op.fixed * t.launch_us
    return op.bytes / (t.link_gb_s * 1e3) + op.fixed * t.collective_us


def expert_us(
    t: Target, other_bytes: float, touched_bytes: np.ndarray, flops: np.ndarray, kernels: float, peak_tflops: float
) -> np.ndarray:
    """One MoE layer's expert kernels on each device: HBM or compute bound, plus their launches."""
    return (
        np.maximum((other_bytes + touched_bytes) / (t.hbm_tb_s * 1e6), flops / (peak_tflops * 1e6))
        + kernels * t.launch_us
    )


def travelling_rows(trace: Trace, n: int) -> np.ndarray:
    """float[S, L]: rows the busiest device sends to or receives from the others, each row going
    once to every other device holding one of its picks (experts in contiguous order)."""
    out = np.zeros(trace.ids.shape[:2])
    for s in range(trace.num_steps):
        ids = trace.step_ids(s)  # [L, R, k]
        rows = ids.shape[1]
        visits = np.zeros((ids.shape[0], rows, n), bool)  # [L, R, N]: row r goes to device d
        np.put_along_axis(visits, ids // (trace.num_experts // n), True, axis=2)
        home = metrics.own_devices(rows, n)
        visits[:, np.arange(rows), home] = False
        sent = np.stack([visits[:, home == d].sum(axis=(1, 2)) for d in range(n)], axis=-1)  # [L, N]
        out[s] = np.maximum(sent, visits.sum(axis=1)).max(axis=-1)
    return out


def phase_us(c: Candidate, phase: str, trace: Trace, t: Target, model: ModelConfig) -> CallTime:
    """Mean time of one call of `c`'s program `phase` over `trace`'s steps."""
    p, layout, moe_layers = c.programs[phase], c.layout, len(model.moe_layers)
    out = dict.fromkeys(CATEGORIES, 0.0)
    expert_bytes = expert_kernels = ragged_bytes = ragged_ops = 0.0
    for op in p.ops:
        if category(op) == "experts":
            expert_bytes, expert_kernels = expert_bytes + op.count * op.bytes, expert_kernels + op.count
        elif op.kind == "ragged-all-to-all":
            ragged_bytes, ragged_ops = ragged_bytes + op.count * op.bytes, ragged_ops + op.count
        else:
            out[category(op)] += op.count * op_us(op, t)
    work = device_work(trace, layout, eplb.contiguous(moe_layers, model.num_experts), model.moe_intermediate_size)
    other = max(0.0, expert_bytes / moe_layers - work.held * c.expert_bytes)
    peak = t.fp4_tflops if c.kernel == "blackwell" and t.fp4_tflops else t.bf16_tflops
    flops = 2 * calc.expert_params(model) / layout.tp * work.routes  # [S, L, N]
    layers = expert_us(t, other, work.experts * c.expert_bytes, flops, expert_kernels / moe_layers, peak)
    out["experts"] = float(layers.max(axis=-1).sum(axis=-1).mean())
    if ragged_ops:  # compiled for every row going to every other device: scaled to the rows that go
        share = np.minimum(1.0, travelling_rows(trace, layout.devices) / (p.rows * (layout.devices - 1)))
        out["exchange"] += (
            ragged_bytes / moe_layers * share.sum(axis=-1).mean() / (t.link_gb_s * 1e3) + ragged_ops * t.collective_us
        )
    return CallTime.of(out)
