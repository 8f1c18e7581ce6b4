"""A compiled program's optimized HLO text (`compiled.as_text()`), read once (`parse`) into its
computations and the instructions one call runs as ops of their own (`Run`: the entry's, its loops'
bodies and conditions', its conditionals' branches' and called computations', not those fused into
a fusion), each with how many times it runs. What the project asks of a compiled program is read
off them: the arrays of given shapes it writes (`writes_of`, `weight_shaped`), its products
(`products`), its loops and their trip counts (`loops`), the kernels it launches (`launches`, by
kind: `by_kind`), its Pallas kernels (`pallas_calls`: Triton, Mosaic GPU or Mosaic TPU, each with its
kernel's name, programs and operands' bytes), its collectives (`collectives`) and its transfers to
and from the host (`host_transfers`); `hlo_ops` prices the operations it runs. Tests read compiled
programs through these readers alone (test_hlo.py holds them to it).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import re

BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "f4e2m1fn": 0.5,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e8m0fnu": 1,
    "f8e4m3b11fnuz": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
    "c64": 8,
    "c128": 16,
}
SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
# Values without memory traffic of their own, and the halves of async pairs whose start is priced.
FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "partition-id",
    "replica-id",
    "after-all",
    "add-dependency",
    "opt-barrier",
    "async-update",
    "async-done",
    "copy-done",
    "call-done",
    "domain",
}
# Ops that run the computations they name (a loop's body and condition, a conditional's branches, a
# call's callee, an async op's wrapped op): their computations' ops run, not they themselves.
CONTAINERS = {"while", "conditional", "call", "call-start", "async-start"}
# The custom-call targets of Pallas kernels, by the compiler that lowered them.
PALLAS = {
    "__gpu$xla.gpu.triton": "triton",
    "mosaic_gpu": "mosaic_gpu",
    "mosaic_gpu_v2": "mosaic_gpu",
    "tpu_custom_call": "mosaic_tpu",
}
# The ops that move arrays between devices (an async one's start; its done only waits).
COLLECTIVES = {
    "all-gather",
    "all-reduce",
    "all-to-all",
    "ragged-all-to-all",
    "reduce-scatter",
    "collective-permute",
    "collective-broadcast",
}
# The ops that move arrays between the device and the host, beside a custom call to a Python callback.
HOST_OPS = {"infeed", "outfeed", "send", "send-done", "recv", "recv-done"}


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    type: str  # the result's type: a shape or a tuple of them
    opcode: str
    args: str  # between its parentheses: operands (a parameter's: its index; a constant's: its value)
    attrs: str  # after them
    root: bool

    @property
    def operands(self) -> list[str]:
        return re.findall(r"%([\w.\-]+)", self.args)

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The dimensions of each array of its result (a tuple's elements, in order)."""
        return [tuple(int(d) for d in sizes.split(",") if d) for _, sizes in SHAPE.findall(self.type)]

    @property
    def scope(self) -> str:
        """Its op_name: the named scopes it was traced under ("" when the compiler dropped it)."""
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    @property
    def target(self) -> str:
        """A custom call's target ("__gpu$xla.gpu.triton", "tpu_custom_call", "__cublas$gemm"); else ""."""
        m = re.search(r'custom_call_target="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    @property
    def pallas(self) -> str:
        """A Pallas kernel's compiler ("triton", "mosaic_gpu", "mosaic_tpu", by its custom call's
        target: `PALLAS`); else ""."""
        return PALLAS.get(self.target, "") if self.opcode == "custom-call" else ""

    @property
    def kernel(self) -> str:
        """A Pallas kernel's name: the named scope its call was traced under, the one before the
        call's own in its op_name (".../ragged_paged_attention_kernel/pallas_call",
        ".../paged_attention_mgpu/mpmd_map"; "jit(grouped_gemm)/pallas_call": "grouped_gemm"); else ""."""
        scopes = self.scope.split("/")
        if not self.pallas or len(scopes) < 2:
            return ""
        m = re.fullmatch(r"jit\((.*)\)", scopes[-2])
        return m.group(1) if m else scopes[-2]

    @property
    def programs(self) -> int:
        """A Pallas GPU call's programs, its grid's product: a Triton call's backend config states its
        grid (grid_x, grid_y, grid_z); a Mosaic GPU call's holds its module as bytecode, so its kernel
        traces it under a named scope "grid_AxB" (`pallas_kernels.paged_attention_mgpu`); 0 where
        neither says."""
        stated = re.findall(r"\bgrid_[xyz] = (\d+) : i32", self.backend_config)
        scoped = re.search(r"(?:^|/)grid_(\d+(?:x\d+)*)(?:/|$)", self.scope)
        sizes = stated or (scoped.group(1).split("x") if scoped else [])
        return math.prod(int(d) for d in sizes) if sizes and self.pallas else 0

    @property
    def function(self) -> str:
        """The kernel function a Triton call's backend config names ("_linear_kernel"); else ""."""
        m = re.search(r'\bname = "([^"]*)"', self.backend_config)
        return m.group(1) if m and self.pallas == "triton" else ""

    @property
    def operand_bytes(self) -> float:
        """A custom call's operands' bytes (`operand_types`): what it reads, or at most that where it
        reads part of an operand (a page pool's pages, the picked experts of a layer's)."""
        return sum(shape_bytes(t) for t in self.operand_types)

    @property
    def collective(self) -> str:
        """The collective it is or starts ("all-gather" of an all-gather-start; `COLLECTIVES`); else ""."""
        op = self.opcode.removesuffix("-start")
        return op if op in COLLECTIVES else ""

    @property
    def dtypes(self) -> list[str]:
        """The element type of each array of its result, in order (as `shapes`)."""
        return [dtype for dtype, _ in SHAPE.findall(self.type)]

    @property
    def operand_types(self) -> list[str]:
        """A custom call's operands' types as its layout constraints state them ("f32[1,2]"), in order."""
        m = re.search(r"operand_layout_constraints=\{", self.attrs)
        constraints = self.attrs[m.end() - 1 : _close(self.attrs, m.end() - 1)] if m else ""
        return [f"{dtype}[{sizes}]" for dtype, sizes in SHAPE.findall(constraints)]

    @property
    def backend_config(self) -> str:
        """Its backend config as printed, braces included: JSON for Mosaic TPU's calls and cuBLAS
        GEMMs; MLIR attributes for Triton's and Mosaic GPU's, with their kernels' IR; else ""."""
        m = re.search(r"\bbackend_config=\{", self.attrs)
        return self.attrs[m.end() - 1 : _close(self.attrs, m.end() - 1) + 1] if m else ""

    @property
    def precision(self) -> tuple[str, ...]:
        """A product's operands' precision: a dot's `operand_precision`, a cuBLAS GEMM's (its
        config's), lower case ("highest", "highest"); () where it is the default."""
        m = re.search(r"operand_precision=\{([a-z,]*)\}", self.attrs) or re.search(
            r'"operand_precision":\[([^\]]*)\]', self.backend_config
        )
        return tuple(p.strip('"').lower() for p in m.group(1).split(",")) if m else ()

    @property
    def fusion_kind(self) -> str:
        """A fusion's kind: kLoop, kInput, kOutput, or a custom fusion's backend (XLA:GPU's Triton
        fusions: "__triton_nested_gemm_fusion", "__triton"; XLA:CPU's YNNPACK ones: "__ynn_fusion"); else ""."""
        m = re.search(r'"fusion(?:_backend)?_config":\{"kind":"([^"]+)"', self.attrs) or re.search(
            r"\bkind=(k\w+)", self.attrs
        )
        return m.group(1) if m and self.opcode == "fusion" else ""

    @property
    def kind(self) -> str:
        """What it is, for breakdowns: "fusion <its kind>", "custom-call <its target>", else its opcode."""
        if self.opcode == "fusion":
            return f"fusion {self.fusion_kind}"
        return f"custom-call {self.target}" if self.opcode == "custom-call" else self.opcode

    def called(self, key: str) -> str | None:
        """The computation it names by `key` ("calls", "body", "condition", "to_apply", ...)."""
        return _attr(self.attrs, key)


def shape_bytes(type_: str) -> float:
    return sum(
        math.prod(int(d) for d in sizes.split(",") if d) * BYTES.get(dtype, 0) for dtype, sizes in SHAPE.findall(type_)
    )


def dims(type_: str) -> list[int]:
    """The dimensions of the first shape in `type_`."""
    m = SHAPE.search(type_)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _close(text: str, start: int) -> int:
    """Index of the bracket closing the one at text[start], brackets in quoted strings aside (a
    kernel's IR in its backend config: a PTX "{")."""
    depth, pairs, quoted, escaped = 0, {"(": ")", "{": "}", "[": "]"}, False, False
    opening = text[start]
    for i in range(start, len(text)):
        if quoted:
            quoted, escaped = (escaped or text[i] != '"'), (not escaped and text[i] == "\\")
        elif text[i] == '"':
            quoted = True
        elif text[i] == opening:
            depth += 1
        elif text[i] == pairs[opening]:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced HLO: {text[start : start + 80]}")


def _instr(line: str) -> Instr:
    root = line.startswith("ROOT ")
    name, rest = line[5 if root else 0 :].split(" = ", 1)
    if rest.startswith("("):
        end = _close(rest, 0)
        type_, rest = rest[: end + 1], rest[end + 2 :]
    else:
        type_, rest = rest.split(" ", 1)
    opcode, rest = rest.split("(", 1)
    end = _close("(" + rest, 0)
    return Instr(name.lstrip("%"), type_, opcode, rest[: end - 1], rest[end:], root)


def computations(text: str) -> tuple[dict[str, list[Instr]], str]:
    """({computation: its instructions}, the entry computation's name)."""
    comps, entry, current = {}, "", None
    for line in text.splitlines():
        if current is None:
            m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
            if m:
                current = comps.setdefault(m.group(2), [])
                entry = m.group(2) if m.group(1) else entry
        elif line.startswith("}"):  # "}" or "}, execution_thread=..."
            current = None
        elif line.strip():
            current.append(_instr(line.strip()))
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _attr(attrs: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=%([\w.\-]+)", attrs)
    return m.group(1) if m else None


def dot_flops(comps: dict, comp: str, seen: frozenset = frozenset()) -> float:
    """Flops of the dots and convolutions in a fused computation (and the ones it calls)."""
    symbols = {i.name: i for i in comps.get(comp, [])}
    total = 0.0
    for i in comps.get(comp, []):
        if i.opcode == "dot":
            lhs = dims(symbols[i.operands[0]].type)
            m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i.attrs)
            contracted = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m else 1
            total += 2 * math.prod(dims(i.type)) * contracted
        elif i.opcode == "convolution":  # a dot on TPU: each output sums over the kernel's non-output dims
            labels = re.search(r"dim_labels=\w+_(\w+)->", i.attrs).group(1)
            rhs = dims(symbols[i.operands[1]].type)
            total += 2 * math.prod(dims(i.type)) * math.prod(s for s, c in zip(rhs, labels) if c != "o")
        callee = i.called("calls")
        if callee and callee not in seen:
            total += dot_flops(comps, callee, seen | {comp})
    return total


def kernel_flops(i: Instr, symbols: dict, comps: dict) -> float:
    if i.opcode == "fusion":
        return dot_flops(comps, i.called("calls"))
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', i.attrs)
    if i.opcode == "custom-call" and "cublas" in i.attrs and m:  # a library GEMM: its dot's numbers
        lhs = dims(symbols[i.operands[0]].type)
        return 2 * math.prod(dims(i.type)) * math.prod(lhs[int(d)] for d in re.findall(r"\d+", m.group(1)))
    return 0.0


def known_trip_count(loop: Instr) -> int | None:
    """The trip count XLA states for a while loop (`known_trip_count`: XLA:GPU runs its body that
    many times without evaluating its condition), else None."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop.attrs)
    return int(m.group(1)) if m else None


def _trips(i: Instr, symbols: dict, comps: dict) -> int:
    """A while loop's trip count: XLA's `known_trip_count` (XLA:GPU), else read off its condition
    (the TPU compiler's): a counter the loop carries from a constant start, compared less than a
    constant bound; else 1."""
    known = known_trip_count(i)
    if known is not None:
        return known
    cond = {c.name: c for c in comps[i.called("condition")]}
    root = next(c for c in cond.values() if c.root)
    if root.opcode != "compare" or "direction=LT" not in root.attrs:
        return 1
    counter, bound = (cond[o] for o in root.operands)
    if counter.opcode != "get-tuple-element" or bound.opcode != "constant":
        return 1
    init = symbols[i.operands[0]]
    start = (
        symbols[init.operands[int(re.search(r"index=(\d+)", counter.attrs).group(1))]]
        if init.opcode == "tuple"
        else None
    )
    return max(1, int(bound.args) - (int(start.args) if start is not None and start.opcode == "constant" else 0))


@dataclasses.dataclass(frozen=True)
class Run:
    """An instruction one call of a program runs as an op of its own."""

    instr: Instr
    computation: str  # the computation holding it
    count: float  # runs per call: its loops' trip counts multiplied, shared among a conditional's branches
    trips: int  # the trip count of the innermost loop it runs in (1 outside loops)
    condition_of: Instr | None = None  # the while loop whose condition it runs in (the innermost)


class Program:
    """Optimized HLO text parsed once: its computations, and `runs`, the instructions one call runs
    as ops of their own, in program order (a loop's condition and body after the loop)."""

    def __init__(self, text: str):
        self.comps, self.entry = computations(text)
        self.symbols = {name: {i.name: i for i in instrs} for name, instrs in self.comps.items()}
        self.runs: list[Run] = []
        self._walk(self.entry, 1.0, 1, None)

    def _walk(self, comp: str, count: float, trips: int, condition_of: Instr | None) -> None:
        for i in self.comps[comp]:
            self.runs.append(Run(i, comp, count, trips, condition_of))
            if i.opcode == "while":
                t = _trips(i, self.symbols[comp], self.comps)
                self._walk(i.called("condition"), count * (t + 1), t, i)
                self._walk(i.called("body"), count * t, t, condition_of)
            elif i.opcode == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", i.attrs)
                branches = (
                    re.findall(r"%([\w.\-]+)", m.group(1))
                    if m
                    else [i.called("true_computation"), i.called("false_computation")]
                )
                for b in branches:
                    self._walk(b, count / len(branches), trips, condition_of)
            elif i.opcode in CONTAINERS:  # a call, or an async op's wrapped op
                self._walk(i.called("to_apply") or i.called("calls"), count, trips, condition_of)

    @property
    def instrs(self) -> list[Instr]:
        """Every instruction of every computation, those fused into fusions included."""
        return list(itertools.chain.from_iterable(self.comps.values()))

    def root_of(self, i: Instr) -> Instr:
        """The instruction computing what `i` writes: a fusion's root, any other op itself."""
        return next(f for f in self.comps[i.called("calls")] if f.root) if i.opcode == "fusion" else i


@functools.lru_cache(maxsize=4)
def parse(text: str) -> Program:
    """The program of optimized HLO text (its last few parses kept: callers ask several questions)."""
    return Program(text)


def writes_arrays(i: Instr) -> bool:
    """Whether an instruction writes arrays of its own, not naming, passing on or running others'."""
    return not (i.opcode in FREE or i.opcode in CONTAINERS or i.opcode.endswith("-done"))


def _sizes(shape, ordered: bool) -> tuple[int, ...]:
    """A shape's sizes other than 1: sorted (a copy's, however transposed or reshaped) unless
    `ordered` (as laid out: a [D, E] weight told from [E, D] rows)."""
    kept = [d for d in shape if d != 1]
    return tuple(kept if ordered else sorted(kept))


def writes_of(text: str, shapes, ordered: bool = False) -> list[Run]:
    """The runs writing an array (any element of a tuple result) of one of `shapes`, compared by
    their sizes other than 1 (`ordered`: in their order, else sorted)."""
    wanted = {_sizes(s, ordered) for s in shapes}
    return [
        r
        for r in parse(text).runs
        if writes_arrays(r.instr) and any(_sizes(s, ordered) in wanted for s in r.instr.shapes)
    ]


def weight_shaped(text: str, shapes) -> list[Run]:
    """The runs writing an array of one of the weight `shapes` as laid out (sizes other than 1, in
    order): a weight copied, or a product spelled out as a multiply the weight's size and a reduce.
    Only weights of at least two sizes other than 1 count: a norm's [D] is an activation's [1, 1, D]."""
    return writes_of(text, [s for s in shapes if sum(d != 1 for d in s) >= 2], ordered=True)


def products(text: str) -> list[Run]:
    """The runs computing matrix products: dots and convolutions, fusions holding them (XLA:GPU's
    Triton GEMMs) and library GEMMs (cuBLAS); a Pallas kernel's are its own, not the HLO's."""
    program = parse(text)
    return [
        r
        for r in program.runs
        if r.instr.opcode in ("dot", "convolution")
        or kernel_flops(r.instr, program.symbols[r.computation], program.comps) > 0
    ]


def loops(text: str) -> list[Run]:
    """The while loops a call runs (`known_trip_count(r.instr)`: None where XLA does not know it)."""
    return [r for r in parse(text).runs if r.instr.opcode == "while"]


def launches(text: str) -> list[Run]:
    """The kernels one call launches as XLA:GPU runs them (`Run.count` times each): fusions, custom
    calls (Triton, Mosaic, cuBLAS), copies, collectives (an async pair's start), sorts, scatters
    and every other op that is not free, in the entry, loop bodies (times their trips), branches
    and called computations; a loop's condition where XLA does not know its trip count (it then
    evaluates it every trip). Not launches: the values without work of their own (`FREE`), the
    second halves of async pairs and the ops that run computations (`CONTAINERS`)."""
    return [
        r
        for r in parse(text).runs
        if writes_arrays(r.instr) and (r.condition_of is None or known_trip_count(r.condition_of) is None)
    ]


def by_kind(runs: list[Run]) -> dict[str, float]:
    """Runs per call by `Instr.kind` (fusion kind, custom-call target or opcode), most first."""
    counts = collections.Counter()
    for r in runs:
        counts[r.instr.kind] += r.count
    return dict(counts.most_common())


def pallas_calls(text: str) -> list[Run]:
    """The Pallas kernels a call launches (`Instr.pallas`: which compiler's; `Instr.kernel`: which kernel)."""
    return [r for r in launches(text) if r.instr.pallas]


def collectives(text: str) -> list[Run]:
    """The collectives a call runs (`Instr.collective`), in program order."""
    return [r for r in parse(text).runs if r.instr.collective]


def host_transfers(text: str) -> list[Run]:
    """The ops a call runs that move arrays to or from the host: infeeds, outfeeds, sends and
    receives, and custom calls to Python callbacks (`jax.debug.callback`, `pure_callback`)."""
    return [
        r
        for r in parse(text).runs
        if r.instr.opcode in HOST_OPS or (r.instr.opcode == "custom-call" and "callback" in r.instr.target)
    ]
