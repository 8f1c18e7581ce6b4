"""The operations one call of a compiled program runs (`ops`), as `target_pricing` prices them: each
kernel (fusion, custom call, copy, ...) with the bytes it reads and writes and the flops of its
dots, each collective with the bytes every device sends, and how many times it runs; read off the
program's runs (`hlo.parse`).

First-order bytes, per kernel: its operands' and its result's. Three corrections keep the
engine's programs from being priced at many times their traffic:
  * a fusion reads only the slices of an operand it reaches through (dynamic-)slices or gathers
    (a layer's weights out of the stacked run, a KV cache's rows), also after a layout change;
  * an update in place (a fusion whose root is a dynamic-update-slice or scatter, writing the
    KV cache) moves its update, not the buffer it updates;
  * inside a layer loop of T trips, a custom call handed the whole [T, ...] stack (a kernel
    reading its layer in place) reads one layer of it per trip.
A while loop's body runs its trip count times (XLA's `known_trip_count`, or its condition's
constant bound), once where that is not known (the XLA grouped GEMM's loop over groups), its
condition once more (not priced; launched only where XLA does not know the trip count); a
conditional's branches each count 1 / branches. Collectives send, per device of a group of n, over its links (ring
algorithms): all-gather (n - 1) x its operand, reduce-scatter and all-to-all (n - 1) / n of it,
all-reduce twice that, collective-permute its operand; a ragged all-to-all is sized for the worst
case, which the caller scales by the rows that really travel (`target_pricing`). A collective the
compiler combined from several is split back into one per operand, each with its own scope, the
latency counted once.
"""

from __future__ import annotations

import dataclasses
import math
import re

from moejax.compiled.hlo import SHAPE, Instr, dims, kernel_flops, parse, shape_bytes, writes_arrays

COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)
SLICES = {"dynamic-slice", "slice", "gather"}
MOVES = {"bitcast", "copy", "reshape", "transpose", "convert"}  # of one operand: its elements moved, not read whole
IN_PLACE = {"dynamic-update-slice", "scatter"}


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str  # "kernel", or the collective (`COLLECTIVES`)
    scope: str  # its op_name: the named scopes it was traced under ("" when the compiler dropped it)
    bytes: float  # kernel: bytes read and written; collective: bytes each device sends
    flops: float  # its dots' (0 for a custom call: a Pallas kernel's are not in the HLO)
    count: float  # runs per call of the program
    fixed: int = 1  # launches or collective latencies per run (0: a later part of a combined collective)


def group_size(attrs: str, devices: int) -> int:
    """Devices in each replica group of a collective."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:  # mesh['axis_0'=8,'axis_1'=1] {'axis_0'}
        sizes = {k: int(v) for k, v in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", m.group(2)))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
    if m:  # iota groups [groups, size]<=[...]
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    return len(m.group(1).split(",")) if m else devices


def _sliced_bytes(comps: dict, instrs: list[Instr], name: str) -> float | None:
    """Bytes of `name` that `instrs` read where they read only slices of it (through ops that
    move its elements, and into nested fusions: the TPU compiler's layout changes), else None."""
    total, read = 0.0, False
    for i in instrs:
        for k, operand in enumerate(i.operands):
            if operand != name:
                continue
            read = True
            if i.opcode in SLICES and k == 0:
                part = shape_bytes(i.type)
            elif i.opcode == "fusion":  # slices inside it, or (a layout change) slices of what it gives
                inner = comps[i.called("calls")]
                part = _sliced_bytes(
                    comps, inner, next(f.name for f in inner if f.opcode == "parameter" and int(f.args) == k)
                )
                if part is None and len(i.operands) == 1:
                    part = _sliced_bytes(comps, instrs, i.name)
            elif i.opcode in MOVES and len(i.operands) == 1:
                part = _sliced_bytes(comps, instrs, i.name)
            else:
                return None
            if part is None:
                return None
            total += part
    return total if read else None


def _layer_stack(symbols: dict, name: str, trips: int) -> bool:
    """Whether `name` is (a bitcast of) a [trips, ...] stack the enclosing loop carries: an element
    of its parameter."""
    i = symbols[name]
    while i.opcode == "bitcast":
        i = symbols[i.operands[0]]
    return (
        i.opcode == "get-tuple-element" and symbols[i.operands[0]].opcode == "parameter" and dims(i.type)[:1] == [trips]
    )


def _kernel_bytes(i: Instr, symbols: dict, comps: dict, trips: int) -> float:
    fused = comps.get(i.called("calls"), []) if i.opcode == "fusion" else []
    params = {int(f.args): f for f in fused if f.opcode == "parameter"}
    root = next((f for f in fused if f.root), i)
    in_place = root.opcode in IN_PLACE
    total = 0.0
    for k, name in enumerate(i.operands):
        type_ = symbols[name].type
        if in_place and SHAPE.findall(type_) == SHAPE.findall(i.type):
            continue  # the buffer updated in place
        size = shape_bytes(type_)
        sliced = _sliced_bytes(comps, fused, params[k].name) if k in params else None
        if sliced is not None:
            size = sliced
        elif i.opcode == "custom-call" and trips > 1 and _layer_stack(symbols, name, trips):
            size /= trips  # a layer of the stack the loop runs over
        total += size
    if i.opcode == "copy-start":  # its result is (destination, source, context)
        return 2 * total
    return 2 * total if in_place else total + shape_bytes(i.type)


def _collective(kind: str, i: Instr, symbols: dict, n: int, count: float) -> list[Op]:
    """A collective's bytes; one op per operand where the compiler combined several (its op_name
    then lists theirs: "prefix/(a:b:c)"), so that each part keeps its own scope."""
    sizes = [shape_bytes(symbols[o].type) for o in i.operands]
    if kind == "ragged-all-to-all":  # (input, output, offsets and sizes): the input's rows go out
        return [Op(kind, i.scope, sizes[0] * (n - 1) / n, 0.0, count)]
    share = {
        "all-gather": n - 1,
        "reduce-scatter": (n - 1) / n,
        "all-to-all": (n - 1) / n,
        "all-reduce": 2 * (n - 1) / n,
    }.get(kind, 1.0)
    m = re.fullmatch(r"(.*/|)\(([^()]*)\)", i.scope)
    parts = [m.group(1) + part for part in m.group(2).split(":")] if m else []
    if len(parts) != len(sizes):
        return [Op(kind, i.scope, sum(sizes) * share, 0.0, count)]
    return [Op(kind, scope, size * share, 0.0, count, int(k == 0)) for k, (scope, size) in enumerate(zip(parts, sizes))]


def ops(text: str, devices: int) -> list[Op]:
    """Every kernel and collective one call of the program runs (`devices`: the program's), a
    loop's condition aside."""
    program = parse(text)
    out: list[Op] = []
    for r in program.runs:
        i, symbols = r.instr, program.symbols[r.computation]
        kind = i.opcode.removesuffix("-start")
        if r.condition_of is not None or not writes_arrays(i):
            continue
        if kind in COLLECTIVES:
            out.extend(_collective(kind, i, symbols, group_size(i.attrs, devices), r.count))
        else:
            out.append(
                Op(
                    "kernel",
                    i.scope,
                    _kernel_bytes(i, symbols, program.comps, r.trips),
                    kernel_flops(i, symbols, program.comps),
                    r.count,
                )
            )
    return out
