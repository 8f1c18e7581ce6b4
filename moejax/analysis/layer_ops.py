"""A layer of the decode step as a target's compiler builds it (`plan --target` prints it): the
difference of the steps of two depths, so it holds for a model whose whole step does not fit the
target's memory (Qwen3-30B-A3B's 61 GB on one 16 GB v5e). Its synchronous ops by what they are and
by the part of the layer they were traced in, and the bytes it moves (`hlo_ops.ops`); the step's
bytes at the datasheet bandwidth are its HBM bound.

The layer priced on the target (`predicted`): every op of both depths' programs at
`target_pricing.op_us`, by `target_pricing.CATEGORIES`, a layer the difference, and a step the
shallower step's time and the layer's for each layer more. What is estimated there:
  * the compiled program as it is, with no routing: every local expert read in full (a device whose
    rows touch only some of its experts reads less: at 8 requests of GLM-5.3 uniform routing
    touches about a fifth of them, at 64 most), a ragged all-to-all at the size it is compiled for
    (every row to every other device); routing imbalance, which makes the busiest device set the
    step, ignored (`advise --target` prices both against a routing trace);
  * every operand from HBM at the datasheet bandwidth, or the dots' flops at the bf16 peak (a
    Pallas kernel's flops are not in the HLO: it is priced by its bytes);
  * no overlap (an async collective or copy adds its time like any other op) and no contention;
  * a constant cost per kernel (`Target.launch_us`, the gap between kernels of a CUDA graph) and per
    collective (`Target.collective_us`), both estimates (`moejax.base.targets`);
  * the model's first dense layer in the shallower step, every other layer priced as the MoE layer
    (GLM-5.3's two other dense layers among them)."""

from __future__ import annotations

import collections
import dataclasses

from moejax.analysis import hlo_ops
from moejax.analysis.target_pricing import CATEGORIES, category, op_us
from moejax.base.targets import Target
from moejax.compiled import hlo, plan
from moejax.config import Config

# The depths whose steps' difference is a layer: the TPU compiler builds a layer scan of 2 trips
# otherwise than a longer one (async slices of its weights and a concatenation: 49 synchronous ops a
# Qwen3-30B-A3B layer on a v5e, against 51 from 3 layers on).
DEPTHS = (3, 4)
# What a layer's ops count as (`group`). Async starts (a weight's copy or slice into on-chip memory)
# overlap the ops around them: a layer's ops are the others.
GROUPS = ("fusions", "custom calls", "copies", "sorts", "collectives", "other")
ASYNC = "async starts"


def at_depth(model, layers: int):
    """`model` `layers` deep: its first dense layer, if it has any, then MoE layers (its sliding and
    DSA-shared layers those among them)."""
    return dataclasses.replace(
        model,
        num_layers=layers,
        dense_layers=model.dense_layers[:1],
        sliding_layers=tuple(i for i in model.sliding_layers if i < layers),
        dsa_shared_layers=tuple(i for i in model.dsa_shared_layers if i < layers),
    )


def group(i: hlo.Instr) -> str:
    """One of GROUPS for an op a call runs (`hlo.launches`), or ASYNC for the start of an async op
    that is no collective."""
    if i.collective:
        return "collectives"
    if i.opcode.endswith("-start"):
        return ASYNC
    return {"fusion": "fusions", "custom-call": "custom calls", "copy": "copies", "sort": "sorts"}.get(
        i.opcode, "other"
    )


def part(scope: str) -> str:
    """The part of a layer an op was traced in: the named scopes inside its run's ("attention/qkv",
    "moe/experts"), jits and the primitive aside; "" outside a run (the layer loop's own ops, and
    those the compiler made)."""
    names = scope.split("/")
    runs = [k for k, name in enumerate(names) if name.endswith("_layers")]
    inner = [name for name in names[runs[0] + 1 : -1] if not name.startswith("jit(")] if runs else []
    return "/".join(inner[:2])


def _step(text: str, devices: int, t: Target) -> tuple[collections.Counter, collections.Counter, float, dict]:
    """(a step's ops by `group`, its synchronous ops by (`part`, `Instr.kind`), the bytes its kernels
    read and write, its microseconds on `t` by CATEGORIES)."""
    groups, parts = collections.Counter(), collections.Counter()
    for r in hlo.launches(text):
        g = group(r.instr)
        groups[g] += r.count
        if g != ASYNC:
            parts[part(r.instr.scope), r.instr.kind] += r.count
    ops = hlo_ops.ops(text, devices)
    moved = sum(op.bytes * op.count for op in ops if op.kind == "kernel")
    us = dict.fromkeys(CATEGORIES, 0.0)
    for op in ops:
        us[category(op)] += op.count * op_us(op, t)
    return groups, parts, moved, us


def depth_programs(config: Config, batch: int, context: int, platform: str, devices: list, page_size: int):
    """The optimized HLO of `config`'s decode step (`batch` requests over `context` positions in
    pages of `page_size`) on `platform`'s `devices` at each of DEPTHS (`at_depth`), or the
    compiler's reason where one does not compile."""
    texts = []
    for layers in DEPTHS:
        deeper = dataclasses.replace(config, model=at_depth(config.model, layers))
        jitted, args = plan.programs(deeper, batch, context, batch, platform, devices, page_size)[1]["decode"]
        program, _, error = plan.compile_program(jitted, args, persist=False)
        if program is None:
            return error
        texts.append(program.as_text())
    return texts


def layer_ops(config: Config, batch: int, context: int, t: Target, devices: list, page_size: int) -> dict:
    """A layer of `config`'s decode step (`batch` requests over `context` positions in pages of
    `page_size`) on `t`'s `devices` (`layer_of`), or the compiler's reason where a step does not
    compile."""
    texts = depth_programs(config, batch, context, t.platform, devices, page_size)
    if isinstance(texts, str):
        return {"depths": DEPTHS, "error": texts}
    return layer_of(config.model.num_layers, texts, t, len(devices))


def layer_of(num_layers: int, texts: list[str], t: Target, devices: int) -> dict:
    """A layer of a `num_layers` model's decode step from its steps at DEPTHS (`depth_programs`, for
    `devices` devices), priced on `t` (a target compiled as another, a B300 as a B200, takes that
    one's programs): the steps less one another (the embedding, LM head and sampling cancel). Its
    synchronous ops, by GROUPS (async starts apart) and by part and kind, the bytes a layer moves,
    and the whole step's (the shallower step's and a layer's for each layer more) with their time
    at the datasheet bandwidth; `predicted`, its kernels, collectives and microseconds by
    CATEGORIES, and the step's milliseconds so priced."""
    (groups0, parts0, bytes0, us0), (groups1, parts1, bytes1, us1) = (_step(text, devices, t) for text in texts)
    n, more = DEPTHS[1] - DEPTHS[0], num_layers - DEPTHS[0]
    less = lambda a, b: {k: round((b[k] - a[k]) / n, 1) for k in sorted(a | b, key=str) if b[k] != a[k]}
    groups, layer_bytes = less(groups0, groups1), (bytes1 - bytes0) / n
    step_bytes = bytes0 + more * layer_bytes
    layer_us = {c: round((us1[c] - us0[c]) / n, 2) for c in CATEGORIES}
    shallow_us = sum(us0.values())
    return {
        "depths": DEPTHS,
        "ops": round(sum(groups.get(g, 0) for g in GROUPS), 1),
        "groups": {g: groups.get(g, 0) for g in (*GROUPS, ASYNC)},
        "parts": [{"part": p, "kind": kind, "ops": ops} for (p, kind), ops in less(parts0, parts1).items()],
        "layer_bytes": int(layer_bytes),
        "step_bytes": int(step_bytes),
        "step_us": round(step_bytes / (t.hbm_tb_s * 1e12) * 1e6, 1),
        "hbm_tb_s": t.hbm_tb_s,
        "predicted": {
            "target": t.name,
            "kernels": round(sum(groups.get(g, 0) for g in GROUPS if g != "collectives"), 1),
            "collectives": groups.get("collectives", 0),
            "layer_bytes": int(layer_bytes),
            "layer_us": round(sum(layer_us.values()), 2),
            "layer_parts_us": layer_us,
            "shallow_step_us": round(shallow_us, 1),
            "step_ms": round((shallow_us + more * sum(layer_us.values())) / 1e3, 4),
        },
    }
