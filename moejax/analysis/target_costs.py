"""`moejax advise --target`: the layouts ranked on an accelerator by its own compiled programs.

Each candidate layout's decode step and prefill chunk compile for the target (`plan.programs`
on `targets.devices`), and their optimized HLO (`hlo.ops`) is priced op by op:

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
A decode step prices the trace's decode steps; a prefill chunk its rows regrouped into chunks of
the chunk's tokens.

Ignored: overlap (async collectives and prefetches run beside compute; here every op adds),
contention (collectives sharing links, kernels sharing HBM), caches (every operand comes from
HBM), and launches a CUDA graph hides.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax import plan, platform
from moejax.analysis import calc, hlo, metrics
from moejax.analysis.simulate import Layout, device_work
from moejax.config import Config, ConfigError, ModelConfig
from moejax.errors import UsageError
from moejax.targets import Target
from moejax.trace import Trace
from sharding import eplb, registry
from sharding.hybrid import Hybrid

GB = 1e9
CATEGORIES = ("attention", "experts", "exchange", "rest")
# Collectives of the MoE block's exchange: its scope, and weight_prefetch's expert gather (an
# all_gather to "invarying", outside it). A ragged all-to-all carries no scope; only exchanges run one.
EXCHANGE_SCOPES = ("moe/", "all_gather_invariant")
# The target's figures a report carries.
TARGET_FIGURES = (
    "name",
    "device_kind",
    "hbm_gb",
    "hbm_tb_s",
    "bf16_tflops",
    "fp4_tflops",
    "link_gb_s",
    "launch_us",
    "collective_us",
)
MAX_PREFILL_CHUNKS = 8  # chunks of the trace's rows a prefill prices (each of thousands of rows)
ONE_DEVICE = "one device"  # the layout of one device: no exchange, every placement the reference


@dataclasses.dataclass(frozen=True)
class Program:
    ops: list  # hlo.Op: what one call runs
    rows: int  # rows per device (a ragged all-to-all's slots per peer)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout compiled for a target."""

    layout: Layout
    kernel: str  # the grouped GEMM it runs
    expert_bytes: float  # one local expert (slice) as a device holds it
    memory_bytes: float  # per device: parameters, KV cache and the larger program's temporaries
    programs: dict  # phase ("decode", "prefill") -> Program


def label(layout: Layout) -> str:
    if layout.devices == 1:
        return ONE_DEVICE
    return (
        f"{layout.name} {layout.ep}x{layout.tp}"
        if registry.placement_class(layout.name).mesh_from_layout
        else layout.name
    )


def layouts(config: Config, n: int, names: list[str]) -> list[Layout]:
    """The placements `names` on n devices at their default meshes, and hybrid at every ep x tp
    (both above 1) the model divides into; on one device the one program every placement is."""
    if n == 1:
        return [Layout(names[0], 1, 1)]
    out = []
    for name in names:
        cls = registry.placement_class(name)
        shapes = (
            [(ep, n // ep) for ep in range(2, n) if n % ep == 0]
            if cls.mesh_from_layout
            else [cls.mesh_shape(dataclasses.replace(config.layout, placement=name, devices=n))]
        )
        for ep, tp in shapes:
            try:
                registry.with_placement(config, name, n, ep, tp)
            except ConfigError:
                continue
            out.append(Layout(name, ep, tp))
    return out


def compile_candidate(
    config: Config, layout: Layout, t: Target, devices: list, batch: int, context: int, chunk: int
) -> Candidate | str:
    """`layout`'s decode step and prefill chunk compiled for `t` on `devices`, or why not."""
    cfg = registry.with_placement(config, layout.name, layout.devices, layout.ep, layout.tp)
    try:
        placement, progs = plan.programs(cfg, batch, context, chunk, t.platform, devices, page_size=plan.PAGE_SIZE)
    except ConfigError as e:  # a kernel or a shape the placement does not take
        return str(e)
    params, cache = progs["decode"][1][:2]
    experts = plan.expert_leaves(params)
    held = placement.num_experts // placement.ep
    temp, programs = 0, {}
    for phase, rows in (("decode", batch), ("prefill", chunk)):
        jitted, args = progs[phase]
        compiled, _, error = plan.compile_program(jitted, args, persist=False)
        if compiled is None:  # the TPU compiler's "temporaries" it refuses count the parameters too
            held = plan.bytes_per_device(params) / GB
            return f"its {phase} does not compile ({held:.1f} GB of parameters a device): {error}"
        temp = max(temp, compiled.memory_analysis().temp_size_in_bytes)
        programs[phase] = Program(hlo.ops(compiled.as_text(), layout.devices), -(-rows // layout.devices))
    return Candidate(
        layout,
        placement.kernel,
        plan.bytes_per_device(experts) / len(cfg.model.moe_layers) / held,
        plan.bytes_per_device(params) + plan.bytes_per_device(cache) + temp,
        programs,
    )


def advise(
    config: Config, trace: Trace, t: Target, devices: list, context: int, chunk: int, names: list[str]
) -> tuple[dict, list[Candidate]]:
    """(`advise --target`'s report, the compiled candidates, which `rank` prices again for
    another trace): the layouts of placements `names` on `devices`, decode steps of the trace's
    rows over `context` positions and prefill chunks of `chunk` tokens, for target `t`."""
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
        if isinstance(c, str):
            skipped.append({"layout": label(layout), "error": c})
        else:
            candidates.append(c)
    if not candidates:
        raise UsageError(f"no layout compiles for {n} {t.name}: {skipped[0]['layout']} {skipped[0]['error']}")
    report = {
        "devices": n,
        "batch": batch,
        "context": context,
        "prefill_chunk": chunk,
        "target": {k: v for k, v in dataclasses.asdict(t).items() if k in TARGET_FIGURES},
        **rank(candidates, config.model, trace, t, chunk),
        "not_compiled": skipped,
    }
    return report, candidates


def category(op: hlo.Op) -> str:
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


def op_us(op: hlo.Op, t: Target) -> float:
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


def phase_us(c: Candidate, phase: str, trace: Trace, t: Target, model: ModelConfig) -> dict:
    """Mean microseconds of one call of `c`'s program `phase` over `trace`'s steps, per category and in all."""
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
    return {"step": sum(out.values()), **out}


def prefill_chunks(trace: Trace, rows: int) -> Trace:
    """The trace's rows, every step's in order, regrouped into steps of `rows` (a prefill chunk's
    tokens; the rows repeat where the trace holds fewer), at most MAX_PREFILL_CHUNKS of them."""
    ids = np.concatenate([trace.step_ids(s) for s in range(trace.num_steps)], axis=1)  # [L, all rows, k]
    ids = np.tile(ids, (1, -(-rows // ids.shape[1]), 1))
    steps = min(MAX_PREFILL_CHUNKS, ids.shape[1] // rows)
    ids = ids[:, : steps * rows].reshape(ids.shape[0], steps, rows, -1).transpose(1, 0, 2, 3)
    return dataclasses.replace(trace, ids=ids, valid=np.ones((steps, rows), bool), kind=np.full(steps, "prefill"))


def ranked(candidates: list[Candidate], phase: str, steps: Trace, t: Target, model: ModelConfig) -> list[dict]:
    """The layouts by predicted time of one call of `phase` over `steps`, those that fit the
    target's memory first."""
    rows = [
        {
            "layout": label(c.layout),
            "placement": c.layout.name,
            "ep": c.layout.ep,
            "tp": c.layout.tp,
            "memory_gb": c.memory_bytes / GB,
            "fits": c.memory_bytes <= t.hbm_gb * GB,
            "us": phase_us(c, phase, steps, t, model),
        }
        for c in candidates
    ]
    return sorted(rows, key=lambda r: (not r["fits"], r["us"]["step"]))


def rank(candidates: list[Candidate], model: ModelConfig, trace: Trace, t: Target, chunk: int) -> dict:
    """Per phase, the layouts ranked, what decides between the first two, and the placements to serve with."""
    decode = trace.select(trace.kind == "decode")
    if not decode.num_steps:
        raise UsageError("the trace has no decode steps to price")
    phases = {}
    for phase, steps in (("decode", decode), ("prefill", prefill_chunks(trace, chunk))):
        rows = ranked(candidates, phase, steps, t, model)
        phases[phase] = {
            "steps": steps.num_steps,
            "rows": int(steps.valid.sum(axis=1).max()),
            "layouts": rows,
            "decides": decides(rows),
        }
    return {"phases": phases, "recommend": recommend(phases)}


def decides(rows: list[dict]) -> dict | None:
    """Between the first two layouts: the lead, and the part of the step that gives most of it; or,
    where the first leads by fitting the target's memory alone, "memory" and its GB a device less."""
    if len(rows) < 2:
        return None
    first, second = rows[0]["us"], rows[1]["us"]
    out = {"first": rows[0]["layout"], "second": rows[1]["layout"], "lead_us": second["step"] - first["step"]}
    if rows[0]["fits"] and not rows[1]["fits"]:
        return {**out, "part": "memory", "part_gb": rows[1]["memory_gb"] - rows[0]["memory_gb"]}
    part = max(CATEGORIES, key=lambda c: second[c] - first[c])
    return {**out, "part": part, "part_us": second[part] - first[part]}


def recommend(phases: dict) -> dict:
    """The decode layout, and the prefill layout that one serve can run beside it (one hybrid mesh
    for both); apart when they differ, with what prefill saves by it."""
    decode = phases["decode"]["layouts"][0]
    prefill_rows = phases["prefill"]["layouts"]
    prefill = next(
        r
        for r in prefill_rows
        if r["placement"] != Hybrid.name or decode["placement"] != Hybrid.name or r["layout"] == decode["layout"]
    )
    same = next(r for r in prefill_rows if r["layout"] == decode["layout"])
    hybrid = next((r for r in (decode, prefill) if r["placement"] == Hybrid.name), None)
    mesh = f" --ep {hybrid['ep']} --tp {hybrid['tp']}" if hybrid else ""
    apart = prefill["layout"] != decode["layout"]
    flags = (
        (
            f"--prefill-placement {prefill['placement']} --decode-placement {decode['placement']}"
            if apart
            else f"--placement {decode['placement']}"
        )
        + mesh
        if decode["layout"] != ONE_DEVICE
        else "--devices 1"
    )
    return {
        "decode": decode["layout"],
        "prefill": prefill["layout"],
        "apart": apart,
        "flags": flags,
        "fits": decode["fits"] and prefill["fits"],
        "decode_us": decode["us"]["step"],
        "prefill_us": prefill["us"]["step"],
        "apart_saves_us": same["us"]["step"] - prefill["us"]["step"],
    }


def table(report: dict) -> str:
    t = report["target"]
    lines = [
        f"{report['model']} on {report['devices']} {t['name']} ({t['device_kind']}): decode {report['batch']} rows "
        f"over {report['context']} positions, prefill chunks of {report['prefill_chunk']} tokens; HBM "
        f"{t['hbm_tb_s']} TB/s, bf16 {t['bf16_tflops']:g} TFLOPS, links {t['link_gb_s']:g} GB/s, "
        f"{t['launch_us']:g} us per kernel, {t['collective_us']:g} us per collective"
    ]
    for phase, p in report["phases"].items():
        lines.append(f"\n{phase} ({p['steps']} steps of {p['rows']} rows), us per call")
        lines.append(f"{'layout':<18}{'step':>9}" + "".join(f"{c:>11}" for c in CATEGORIES) + f"{'GB/device':>11}")
        for r in p["layouts"]:
            us = r["us"]
            lines.append(
                f"{r['layout']:<18}{us['step']:>9.1f}"
                + "".join(f"{us[c]:>11.1f}" for c in CATEGORIES)
                + f"{r['memory_gb']:>11.1f}"
                + ("" if r["fits"] else "  does not fit")
            )
        d = p["decides"]
        if d and d["part"] == "memory":
            lines.append(
                f"{d['first']} leads {d['second']}, {-d['lead_us']:.1f} us slower, by fitting "
                f"{t['hbm_gb']:g} GB: {d['part_gb']:.1f} GB a device less"
            )
        elif d:
            lines.append(
                f"{d['first']} leads {d['second']} by {d['lead_us']:.1f} us: {d['part']} {d['part_us']:.1f} us less"
            )
    for skipped in report["not_compiled"]:
        lines.append(f"{skipped['layout']}: {skipped['error']}")
    r = report["recommend"]
    why = (
        f" (apart: prefill {r['apart_saves_us']:.1f} us faster per chunk than under {r['decode']})"
        if r["apart"]
        else ""
    )
    lines.append(
        f"\nrecommend: serve {r['flags']}{why}; predicted decode step {r['decode_us']:.1f} us, "
        f"prefill chunk {r['prefill_us']:.1f} us"
        + ("" if r["fits"] else f"; but no layout fits {t['hbm_gb']:g} GB per device")
    )
    return "\n".join(lines)
