"""What the placements' accounting shares: the bytes of an expert as stored, and the bytes
a compiled program's collectives send (`hlo_collective_bytes`), against which each
placement's own `bytes_sent_per_device` is checked.
"""

from __future__ import annotations

import re

import jax
import numpy as np

import pallas_kernels

PICK_BYTES = 8  # an int32 expert id and a float32 weight: what a pick costs when it travels


def expert_bytes(experts: dict) -> float:
    """Bytes of one whole expert (gate_up, down) as stored (4-bit values plus scales)."""
    return sum(pallas_kernels.nbytes(a) for a in jax.tree.leaves(experts, is_leaf=_is_quantized)) / _num(experts)


def _is_quantized(x) -> bool:
    return isinstance(x, pallas_kernels.QuantizedArray)


def _num(experts: dict) -> int:
    return experts["down"].shape[0]


# ----------------------------------------------------------------------------- compiled HLO

_COLLECTIVE = re.compile(
    r"= (?P<out>.*?) (?P<op>all-gather|reduce-scatter|all-reduce|all-to-all|ragged-all-to-all)"
    r"(?:-start)?\(.*?replica_groups=(?P<groups>mesh\[[^\]]*\] \{[^}]*\}|\S+)"
)
_SHAPE = re.compile(r"(pred|s8|u8|s32|u32|f32|bf16|f16|s64|f64|f8e4m3fn|f4e2m1fn|f8e8m0fnu)\[([\d,]*)\]")
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "bf16": 2,
    "f16": 2,
    "s64": 8,
    "f64": 8,
    "f8e4m3fn": 1,
    "f8e8m0fnu": 1,
    "f4e2m1fn": 0.5,
}


def _shape_bytes(text: str) -> float:
    return sum(
        _BYTES[d] * int(np.prod([int(x) for x in dims.split(",") if x] or [1])) for d, dims in _SHAPE.findall(text)
    )


def _group_size(groups: str) -> int:
    """Devices per replica group, as XLA prints them: iota ([2,4]<=[8]), lists ({{0,1},{2,3}}),
    or a mesh's axes (mesh['ep'=4,'tp'=2] {'tp'}: the product of the named axes' sizes)."""
    if groups.startswith("mesh["):
        mesh, axes = groups.split("] ", 1)
        sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", mesh)}
        return int(np.prod([sizes[name] for name in re.findall(r"'([^']+)'", axes)]))
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
