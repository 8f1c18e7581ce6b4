"""`advise --target`: the layouts ranked on an accelerator by its own compiled programs.

Each candidate layout compiles for the target (`target_programs`) and its calls are priced over
the trace (`target_pricing`): a decode step over the trace's decode steps, a prefill chunk over
its rows regrouped into chunks of the chunk's tokens. Per phase the layouts that fit the target's
memory come first, fastest first; the decode layout and the prefill layout one serve can run
beside it are recommended.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.analysis import hlo_ops
from moejax.analysis.target_pricing import CATEGORIES, CallTime, phase_us
from moejax.analysis.target_programs import (
    GB,
    ONE_DEVICE,
    Candidate,
    NotCompiled,
    compile_candidate,
    label,
    layouts,
)
from moejax.base import platform
from moejax.base.errors import UsageError
from moejax.base.targets import Target
from moejax.base.trace import Trace
from moejax.config import Config, ModelConfig
from sharding.hybrid import Hybrid

MAX_PREFILL_CHUNKS = 8  # chunks of the trace's rows a prefill prices (each of thousands of rows)


@dataclasses.dataclass(frozen=True)
class LayerShare:
    """A call's kernel launches, collectives and GB a device moves (kernels' reads and writes,
    collectives' sends as compiled: a ragged all-to-all's every slot), over the model's layers: a
    layer's share, the embedding, LM head and sampling spread over them (`plan --target` reads a
    layer exactly, as the difference of two depths)."""

    kernels: float
    collectives: float
    gb: float

    @classmethod
    def of(cls, ops: tuple[hlo_ops.Op, ...], layers: int) -> LayerShare:
        kernels = sum(op.count * op.fixed for op in ops if op.kind == "kernel")
        collectives = sum(op.count * op.fixed for op in ops if op.kind != "kernel")
        moved = sum(op.count * op.bytes for op in ops)
        return cls(round(kernels / layers, 1), round(collectives / layers, 1), round(moved / layers / GB, 4))


@dataclasses.dataclass(frozen=True)
class RankedLayout:
    layout: str  # `target_programs.label`
    placement: str
    ep: int
    tp: int
    memory_gb: float  # per device
    fits: bool  # in the target's memory
    us: CallTime
    layer: LayerShare


@dataclasses.dataclass(frozen=True)
class Lead:
    """What puts the first layout ahead of the second: the part of the step that gives most of
    the lead (`part_us` of it), or "memory" where the first alone fits (`part_gb` a device less;
    its lead in time then negative)."""

    first: str
    second: str
    lead_us: float
    part: str
    part_us: float | None = None
    part_gb: float | None = None


@dataclasses.dataclass(frozen=True)
class PhaseRanking:
    steps: int  # calls priced
    rows: int  # the most rows of one
    layouts: tuple[RankedLayout, ...]  # those that fit first, each group fastest first
    decides: Lead | None  # None: a single layout


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """The decode layout, and the prefill layout that one serve can run beside it (one hybrid mesh
    for both): apart when they differ, with what prefill saves by it."""

    decode: str
    prefill: str
    apart: bool
    flags: str  # serve's
    fits: bool  # both in the target's memory
    decode_us: float
    prefill_us: float
    apart_saves_us: float


@dataclasses.dataclass(frozen=True)
class TargetRanking:
    devices: int
    batch: int  # decode rows
    context: int  # positions each decode row reads
    prefill_chunk: int  # tokens
    target: Target
    phases: dict[str, PhaseRanking]  # "decode", "prefill"
    recommend: Recommendation
    not_compiled: tuple[NotCompiled, ...]


def rank_on_target(
    config: Config, trace: Trace, t: Target, devices: list, context: int, chunk: int, names: list[str]
) -> tuple[TargetRanking, list[Candidate]]:
    """The layouts of placements `names` on `devices` compiled for target `t` and ranked per
    phase: decode steps of the trace's rows over `context` positions, prefill chunks of `chunk`
    tokens; and the compiled candidates, which `ranked` prices again for another trace."""
    n = len(devices)
    if trace.ids.shape[1] != len(config.model.moe_layers):
        raise UsageError(
            f"the trace has {trace.ids.shape[1]} MoE layers but the model has "
            f"{len(config.model.moe_layers)}; pass the trace's model with --preset or --hf"
        )
    config = dataclasses.replace(
        config, engine=dataclasses.replace(config.engine, dtype=platform.run_dtype(config.engine.dtype, t.platform))
    )
    decode = trace.valid[trace.kind == "decode"].sum(axis=1)
    batch = n * -(-int(decode.max(initial=1)) // n)  # the trace's decode rows, split over the devices
    candidates, skipped = [], []
    for layout in layouts(config, n, names):
        c = compile_candidate(config, layout, t, devices, batch, context, chunk)
        (skipped if isinstance(c, NotCompiled) else candidates).append(c)
    if not candidates:
        raise UsageError(f"no layout compiles for {n} {t.name}: {skipped[0].layout} {skipped[0].error}")
    phases = rank(candidates, config.model, trace, t, chunk)
    ranking = TargetRanking(n, batch, context, chunk, t, phases, recommend(phases), tuple(skipped))
    return ranking, candidates


def prefill_chunks(trace: Trace, rows: int) -> Trace:
    """The trace's rows, every step's in order, regrouped into steps of `rows` (a prefill chunk's
    tokens; the rows repeat where the trace holds fewer), at most MAX_PREFILL_CHUNKS of them."""
    ids = np.concatenate([trace.step_ids(s) for s in range(trace.num_steps)], axis=1)  # [L, all rows, k]
    ids = np.tile(ids, (1, -(-rows // ids.shape[1]), 1))
    steps = min(MAX_PREFILL_CHUNKS, ids.shape[1] // rows)
    ids = ids[:, : steps * rows].reshape(ids.shape[0], steps, rows, -1).transpose(1, 0, 2, 3)
    return dataclasses.replace(trace, ids=ids, valid=np.ones((steps, rows), bool), kind=np.full(steps, "prefill"))


def ranked(
    candidates: list[Candidate], phase: str, steps: Trace, t: Target, model: ModelConfig
) -> tuple[RankedLayout, ...]:
    """The layouts by predicted time of one call of `phase` over `steps`, those that fit the
    target's memory first."""
    rows = [
        RankedLayout(
            label(c.layout),
            c.layout.name,
            c.layout.ep,
            c.layout.tp,
            c.memory_bytes / GB,
            c.memory_bytes <= t.hbm_gb * GB,
            phase_us(c, phase, steps, t, model),
            LayerShare.of(c.programs[phase].ops, model.num_layers),
        )
        for c in candidates
    ]
    return tuple(sorted(rows, key=lambda r: (not r.fits, r.us.step)))


def rank(
    candidates: list[Candidate], model: ModelConfig, trace: Trace, t: Target, chunk: int
) -> dict[str, PhaseRanking]:
    """Per phase, the layouts ranked and what decides between the first two."""
    decode = trace.select(trace.kind == "decode")
    if not decode.num_steps:
        raise UsageError("the trace has no decode steps to price")
    phases = {}
    for phase, steps in (("decode", decode), ("prefill", prefill_chunks(trace, chunk))):
        rows = ranked(candidates, phase, steps, t, model)
        phases[phase] = PhaseRanking(steps.num_steps, int(steps.valid.sum(axis=1).max()), rows, decides(rows))
    return phases


def decides(rows: tuple[RankedLayout, ...]) -> Lead | None:
    """Between the first two layouts: the lead, and the part of the step that gives most of it; or,
    where the first leads by fitting the target's memory alone, "memory" and its GB a device less."""
    if len(rows) < 2:
        return None
    first, second = rows[0], rows[1]
    lead = second.us.step - first.us.step
    if first.fits and not second.fits:
        return Lead(first.layout, second.layout, lead, "memory", part_gb=second.memory_gb - first.memory_gb)
    part = max(CATEGORIES, key=lambda c: getattr(second.us, c) - getattr(first.us, c))
    return Lead(first.layout, second.layout, lead, part, part_us=getattr(second.us, part) - getattr(first.us, part))


def recommend(phases: dict[str, PhaseRanking]) -> Recommendation:
    decode = phases["decode"].layouts[0]
    prefill_rows = phases["prefill"].layouts
    prefill = next(
        r
        for r in prefill_rows
        if r.placement != Hybrid.name or decode.placement != Hybrid.name or r.layout == decode.layout
    )
    same = next(r for r in prefill_rows if r.layout == decode.layout)
    hybrid = next((r for r in (decode, prefill) if r.placement == Hybrid.name), None)
    mesh = f" --ep {hybrid.ep} --tp {hybrid.tp}" if hybrid else ""
    apart = prefill.layout != decode.layout
    flags = (
        (
            f"--prefill-placement {prefill.placement} --decode-placement {decode.placement}"
            if apart
            else f"--placement {decode.placement}"
        )
        + mesh
        if decode.layout != ONE_DEVICE
        else "--devices 1"
    )
    return Recommendation(
        decode.layout,
        prefill.layout,
        apart,
        flags,
        decode.fits and prefill.fits,
        decode.us.step,
        prefill.us.step,
        same.us.step - prefill.us.step,
    )
