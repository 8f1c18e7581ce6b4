"""A layer of the decode step as a target's compiler builds it (`plan --target` prints it): the
difference of the steps of two depths, so it holds for a model whose whole step does not fit the
target's memory (Qwen3-30B-A3B's 61 GB on one 16 GB v5e). Its synchronous ops by what they are and
by the part of the layer they were traced in, and the bytes it moves (`hlo_ops.ops`); the step's
bytes at the datasheet bandwidth are its HBM bound."""

from __future__ import annotations

import collections
import dataclasses

from moejax.analysis import hlo_ops
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


def _step(text: str, devices: int) -> tuple[collections.Counter, collections.Counter, float]:
    """(a step's ops by `group`, its synchronous ops by (`part`, `Instr.kind`), the bytes its kernels
    read and write)."""
    groups, parts = collections.Counter(), collections.Counter()
    for r in hlo.launches(text):
        g = group(r.instr)
        groups[g] += r.count
        if g != ASYNC:
            parts[part(r.instr.scope), r.instr.kind] += r.count
    moved = sum(op.bytes * op.count for op in hlo_ops.ops(text, devices) if op.kind == "kernel")
    return groups, parts, moved


def layer_ops(config: Config, batch: int, context: int, t: Target, devices: list, page_size: int) -> dict:
    """A layer of `config`'s decode step (`batch` requests over `context` positions in pages of
    `page_size`) on `t`'s `devices`: the steps of DEPTHS layers (`at_depth`) less one another (the
    embedding, LM head and sampling cancel). Its synchronous ops, by GROUPS (async starts apart) and
    by part and kind, the bytes a layer moves, and the whole step's (the shallower step's and a
    layer's for each layer more) with their time at the datasheet bandwidth; or the compiler's
    reason where a step does not compile."""
    steps = []
    for layers in DEPTHS:
        deeper = dataclasses.replace(config, model=at_depth(config.model, layers))
        jitted, args = plan.programs(deeper, batch, context, batch, t.platform, devices, page_size)[1]["decode"]
        program, _, error = plan.compile_program(jitted, args, persist=False)
        if program is None:
            return {"depths": DEPTHS, "error": error}
        steps.append(_step(program.as_text(), len(devices)))
    (groups0, parts0, bytes0), (groups1, parts1, bytes1) = steps
    n = DEPTHS[1] - DEPTHS[0]
    less = lambda a, b: {k: round((b[k] - a[k]) / n, 1) for k in sorted(a | b, key=str) if b[k] != a[k]}
    groups, layer_bytes = less(groups0, groups1), (bytes1 - bytes0) / n
    step_bytes = bytes0 + (config.model.num_layers - DEPTHS[0]) * layer_bytes
    return {
        "depths": DEPTHS,
        "ops": round(sum(groups.get(g, 0) for g in GROUPS), 1),
        "groups": {g: groups.get(g, 0) for g in (*GROUPS, ASYNC)},
        "parts": [{"part": p, "kind": kind, "ops": ops} for (p, kind), ops in less(parts0, parts1).items()],
        "layer_bytes": int(layer_bytes),
        "step_bytes": int(step_bytes),
        "step_us": round(step_bytes / (t.hbm_tb_s * 1e12) * 1e6, 1),
        "hbm_tb_s": t.hbm_tb_s,
    }
