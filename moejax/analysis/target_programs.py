"""The layouts `advise --target` weighs and their programs compiled for the target: each layout's
decode step and prefill chunk (`plan.programs` on `targets.devices`), its optimized HLO read into
operations (`hlo_ops.ops`) for `target_pricing` to price."""

from __future__ import annotations

import dataclasses

from moejax.analysis import hlo_ops
from moejax.analysis.simulate import Layout
from moejax.base.targets import Target
from moejax.compiled import abstract_arrays, plan
from moejax.config import Config, ConfigError
from sharding import registry

GB = 1e9
ONE_DEVICE = "one device"  # the layout of one device: no exchange, every placement the reference


@dataclasses.dataclass(frozen=True)
class Program:
    ops: tuple[hlo_ops.Op, ...]  # what one call runs
    rows: int  # rows per device (a ragged all-to-all's slots per peer)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout compiled for a target."""

    layout: Layout
    kernel: str  # the grouped GEMM it runs
    expert_bytes: float  # one local expert (slice) as a device holds it
    memory_bytes: float  # per device: parameters, KV cache and the larger program's temporaries
    programs: dict[str, Program]  # by phase: "decode", "prefill"


@dataclasses.dataclass(frozen=True)
class NotCompiled:
    """A layout the target's compiler refused, and the first line of why."""

    layout: str
    error: str


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
) -> Candidate | NotCompiled:
    """`layout`'s decode step and prefill chunk compiled for `t` on `devices`, or why not."""
    cfg = registry.with_placement(config, layout.name, layout.devices, layout.ep, layout.tp)
    try:
        placement, progs = plan.programs(cfg, batch, context, chunk, t.platform, devices, page_size=plan.PAGE_SIZE)
    except ConfigError as e:  # a kernel or a shape the placement does not take
        return NotCompiled(label(layout), str(e))
    params, cache = progs["decode"][1][:2]
    experts = abstract_arrays.expert_leaves(params)
    held = placement.num_experts // placement.ep
    temp, programs = 0, {}
    for phase, rows in (("decode", batch), ("prefill", chunk)):
        jitted, args = progs[phase]
        compiled, _, error = plan.compile_program(jitted, args, persist=False)
        if compiled is None:  # the TPU compiler's "temporaries" it refuses count the parameters too
            gb = abstract_arrays.bytes_per_device(params) / GB
            return NotCompiled(
                label(layout), f"its {phase} does not compile ({gb:.1f} GB of parameters a device): {error}"
            )
        temp = max(temp, compiled.memory_analysis().temp_size_in_bytes)
        programs[phase] = Program(tuple(hlo_ops.ops(compiled.as_text(), layout.devices)), -(-rows // layout.devices))
    return Candidate(
        layout,
        placement.kernel,
        abstract_arrays.bytes_per_device(experts) / len(cfg.model.moe_layers) / held,
        abstract_arrays.bytes_per_device(params) + abstract_arrays.bytes_per_device(cache) + temp,
        programs,
    )
