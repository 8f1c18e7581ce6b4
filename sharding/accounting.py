"""Communication and weight-read accounting per placement, from the exchanges' own sizes.

For one MoE layer and one forward pass (the router's picks `ids: [T, k]` of every row of the
batch, rows laid out over devices as the placement lays them out), each function returns one
number per device. `hlo_collective_bytes` reads the same quantity off a compiled program, so
the two can be checked against each other.
"""

from __future__ import annotations

import re

import jax
import numpy as np

import pallas_kernels
from sharding.ragged_a2a import dispatch_plan

PICK_BYTES = 8  # an int32 expert id and a float32 weight travel with each pick


def expert_bytes(experts: dict) -> float:
    """Bytes of one whole expert (gate, up, down) as stored (4-bit values plus scales)."""
    return sum(pallas_kernels.nbytes(a) for a in jax.tree.leaves(experts, is_leaf=_is_quantized)) / _num(experts)


def _is_quantized(x) -> bool:
    return isinstance(x, pallas_kernels.QuantizedArray)


def _num(experts: dict) -> int:
    return experts["gate"].shape[0]


def dispatch_row_bytes(placement, hidden: int, act_bytes: int) -> int:
    """Bytes of one row as it travels: NVFP4 for ragged_a2a with dispatch_dtype nvfp4."""
    if placement.name == "ragged_a2a" and placement.config.layout.dispatch_dtype == "nvfp4":
        return hidden // 2 + hidden // 16 + 4  # e2m1 values, e4m3 block scales, f32 row scale
    return hidden * act_bytes


def _devices(placement) -> int:
    return placement.ep * placement.tp


def _ragged_counts(placement, ids: np.ndarray) -> np.ndarray:
    """sent[s, d]: rows device s dispatches to device d (the exchange's own plan)."""
    n = _devices(placement)
    e_local = placement.num_experts // placement.ep
    shares = np.array_split(np.asarray(ids), n)
    return np.stack([np.asarray(dispatch_plan(s, e_local, n)[2]) for s in shares])


def bytes_sent_per_device(placement, ids: np.ndarray, hidden: int, act_bytes: int, experts: dict | None = None):
    """Bytes each device sends in one MoE layer: ids [T, k] of all T rows of the pass."""
    n = _devices(placement)
    t, k = ids.shape
    if n == 1:
        return np.zeros(1)
    row = hidden * act_bytes
    dp = placement.rows_sharded
    share = -(-t // n)
    gather_results = 0 if dp else (n - 1) * share * row  # TP attention: results all-gathered
    if placement.name in ("tensor_sliced", "expert_sharded", "hybrid"):
        if dp:  # all-gather rows (+ picks), reduce-scatter partial outputs
            per = (n - 1) * share * (2 * row + k * PICK_BYTES)
        else:  # every row already everywhere: one all-reduce (ring: 2 (n-1)/n of the buffer)
            per = 2 * (n - 1) / n * t * row
        return np.full(n, float(per))
    if placement.name == "ragged_a2a":
        sent = _ragged_counts(placement, ids)
        np.fill_diagonal(sent, 0)
        dispatch = sent.sum(1) * (dispatch_row_bytes(placement, hidden, act_bytes) + k * PICK_BYTES)
        combine = sent.sum(0) * row  # results go back to the rows' devices
        return (dispatch + combine + gather_results).astype(float)
    if placement.name == "weight_prefetch":  # each device's experts go to the n - 1 others
        local = expert_bytes(experts) * placement.num_experts / n
        return np.full(n, (n - 1) * local + gather_results)
    raise ValueError(placement.name)


def copies_per_row(placement, ids: np.ndarray) -> float:
    """Mean number of other devices a row is sent to (the article's 'copies')."""
    n = _devices(placement)
    if placement.name != "ragged_a2a":
        return float(n - 1)
    sent = _ragged_counts(placement, ids)
    np.fill_diagonal(sent, 0)
    return float(sent.sum() / ids.shape[0])


def expert_bytes_read_per_device(placement, ids: np.ndarray, experts: dict) -> np.ndarray:
    """Expert weight bytes each device reads in one layer: its share of every touched expert."""
    n, ep, tp = _devices(placement), placement.ep, placement.tp
    per_expert = expert_bytes(experts)
    if placement.name == "weight_prefetch":  # each device runs all experts its own rows pick
        return np.array([len(np.unique(s)) * per_expert for s in np.array_split(np.asarray(ids), n)])
    touched = np.unique(ids)
    e_local = placement.num_experts // ep
    group = np.bincount(touched // e_local, minlength=ep)  # touched experts per ep group
    return np.repeat(group * per_expert / tp, tp).astype(float)


# ----------------------------------------------------------------------------- compiled HLO

_COLLECTIVE = re.compile(
    r"= (?P<out>.*?) (?P<op>all-gather|reduce-scatter|all-reduce|all-to-all|ragged-all-to-all)"
    r"(?:-start)?\(.*?replica_groups=(?P<groups>\S+)"
)
_SHAPE = re.compile(r"(pred|s8|u8|s32|u32|f32|bf16|f16|s64|f64|f8e4m3fn|f4e2m1fn|f8e8m0fnu)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s32": 4, "u32": 4, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "f64": 8,
          "f8e4m3fn": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5}


def _shape_bytes(text: str) -> float:
    return sum(_BYTES[d] * int(np.prod([int(x) for x in dims.split(",") if x] or [1])) for d, dims in _SHAPE.findall(text))


def _group_size(groups: str) -> int:
    m = re.match(r"\[(\d+),(\d+)\]", groups)
    if m:
        return int(m.group(2))
    first = re.match(r"\{\{([\d,]*)\}", groups)
    return len(first.group(1).split(",")) if first else 1


def hlo_collective_bytes(hlo_text: str) -> float:
    """Bytes one device sends, summed over the collectives of a compiled (per-device) program,
    for ring algorithms, from each op's result shape (operands are not printed): all-gather
    and all-to-all send (n-1)/n of their result, reduce-scatter n-1 times its result, all-reduce
    2 (n-1)/n of it. A dense all-to-all counts its whole worst-case buffer; a ragged one its
    capacity (an upper bound on what it sends)."""
    total = 0.0
    for m in _COLLECTIVE.finditer(hlo_text):
        n = _group_size(m.group("groups"))
        out = _shape_bytes(m.group("out"))
        factor = {"reduce-scatter": n - 1, "all-reduce": 2 * (n - 1) / n}.get(m.group("op"), (n - 1) / n)
        total += factor * out
    return total
