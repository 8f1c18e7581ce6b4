"""Decode programs as accelerators compile them (compile-only devices, `moejax.targets`): a block
of decode steps (`engine.decode_steps`, what `generate` runs) copies no layer of a run's stacked
experts or page pool out of its stack, and holds no loop whose trip count the compiler does not
know (XLA:GPU reads such a loop's condition back to the host on every iteration)."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest
from compile_only import on

import pallas_kernels as pk
from moejax import plan, platform, targets
from moejax.config import Config, EngineConfig, LayoutConfig, WeightsConfig, preset

# Four scanned MoE layers of distinctive widths, a layer's experts larger than a TPU's on-chip memory
# (as a full-size model's: its compiler would otherwise stage small ones there whole): gate_up
# [32, 2048, 1536] and down [32, 768, 2048], its pools of 16-position pages [128, 2, 16, 128] (GPU)
# or [128, 16, 4, 128] (TPU: k and v interleaved); 8 rows of 4 picks (32 rows per expert product:
# past the rows XLA:CPU gathers, within those an accelerator does), 256 positions.
MODEL = dataclasses.replace(
    preset("tiny-qwen3-moe"),
    num_layers=4,
    dense_layers=(),
    hidden_size=2048,
    moe_intermediate_size=768,
    num_experts=32,
    head_dim=128,
)
BATCH, CONTEXT, PAGE_SIZE = 8, 256, 16
KERNELS = ("xla", "auto")  # auto on h100: pallas_gpu; on v5e: pallas_tpu
# Ops that only name or pass on buffers, and the ops whose computations are listed on their own.
PASSING = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call"}
INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%\S+ = (\(.*?\)|\S+) ([\w-]+)\(")


def computations(hlo: str) -> dict[str, list[str]]:
    """Optimized HLO text -> each computation's instruction lines, by name ("ENTRY": the entry's)."""
    out, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) ", line)
        if head and line.rstrip().endswith("{"):
            name = "ENTRY" if head.group(1) else head.group(2)
            out[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            out[name].append(line)
    return out


def run_ops(hlo: str) -> list[tuple[str, str]]:
    """(opcode, output type) of each instruction the program runs as an op of its own: the entry's
    and those of the loops and conditionals it runs (not the instructions fused into a fusion)."""
    comps, todo, seen, ops = computations(hlo), ["ENTRY"], set(), []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in comps[name]:
            m = INSTRUCTION.match(line)
            if m:
                ops.append((m.group(2), m.group(1)))
                if m.group(2) in ("while", "conditional", "call"):
                    todo += re.findall(
                        r"(?:body|condition|to_apply|true_computation|false_computation)=%([\w.-]+)", line
                    )
                    branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                    todo += re.findall(r"%([\w.-]+)", branches.group(1)) if branches else []
    return ops


def dims(shape, ordered: bool = False) -> tuple[int, ...]:
    """A shape's sizes other than 1, sorted: a copy's, however transposed or reshaped (`ordered`:
    in their order, a copy's as laid out, telling a [D, E] weight from [E, D] rows)."""
    kept = [d for d in shape if d != 1]
    return tuple(kept if ordered else sorted(kept))


def copies_of(hlo: str, shapes, ordered: bool = False) -> list[str]:
    """Ops writing an array of one of `shapes` (as `dims` sees them)."""
    wanted = {dims(s, ordered) for s in shapes}
    return [
        f"{op} {out}"
        for op, out in run_ops(hlo)
        if op not in PASSING
        for t in re.findall(r"\w+\[([\d,]*)\]", out)
        if dims((int(d) for d in t.split(",") if d), ordered) in wanted
    ]


def loops_of_unknown_trip_count(hlo: str) -> list[str]:
    return [
        line.strip()[:160]
        for line in hlo.splitlines()
        if re.search(r" while\(", line) and "known_trip_count" not in line
    ]


@functools.cache
def program(target: str, kernel: str, page_size: int):
    """(optimized HLO of a decode block, abstract params, abstract cache, its temporary bytes) on one
    `target` device; page_size 0: a contiguous cache."""
    config = Config(
        model=MODEL,
        layout=LayoutConfig(devices=1),
        weights=WeightsConfig("unquantized"),
        engine=EngineConfig(dtype="bfloat16"),
        kernel=kernel,
    ).validate()
    _, progs = plan.programs(
        config, BATCH, CONTEXT, BATCH, targets.target(target).platform, list(targets.devices(target, 1)), page_size
    )
    jitted, args = progs["decode block"]
    compiled = jitted.lower(*args).compile()
    return compiled.as_text(), *args[:2], compiled.memory_analysis().temp_size_in_bytes


def layer(run):
    """A layer of a run as the program holds it: its stacked tree [layers, ...] (a scan's), or a
    tuple of per-layer trees (an unrolled run's), as a tree of its shapes."""
    if isinstance(run, tuple):
        return jax.tree.map(lambda a: a.shape, run[0])
    return jax.tree.map(lambda a: a.shape[1:], run)


def layer_shapes(tree) -> list[tuple[int, ...]]:
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x))


@pytest.mark.parametrize("page_size", [0, PAGE_SIZE])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("target", ["h100", "v5e"])
def test_decode_steps_copy_no_layer_of_their_experts_or_pages(target, kernel, page_size):
    """No op of a decode block writes an array of a layer's expert matrices' shape (a grouped
    GEMM reads them in their stack, a `layered.LayerOf`), nor of a layer's page pool (attention
    writes and reads a layer's pages through its index into the run's pools)."""
    hlo, params, cache, _ = program(target, kernel, page_size)
    shapes = [s for run in params["layers"] for s in layer_shapes(layer(run)["moe"]["experts"])]
    if page_size:
        shapes += [s for run in cache for s in layer_shapes(layer(run))]
    assert copies_of(hlo, shapes) == []


@pytest.mark.parametrize("page_size", [0, PAGE_SIZE])
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_gpu_reads_every_weight_of_a_layer_where_it_lies(kernel, page_size):
    """On an H100 a decode block writes no array of any layer weight's shape (attention, router,
    norms and experts), nor over pages of a layer's pool: its runs of layers are unrolled
    (`Platform.unrolls`), each layer's weights buffers of their own, where a scan's slice of the
    attention and router weights is a copy XLA:GPU makes before every GEMM. (A contiguous cache is
    split into its layers' buffers once a block and written in place: `kv_cache.per_layer`.)"""
    hlo, params, cache, _ = program("h100", kernel, page_size)
    shapes = [s for run in params["layers"] for s in layer_shapes(layer(run))]
    if page_size:
        shapes += [s for run in cache for s in layer_shapes(layer(run))]
    assert copies_of(hlo, shapes, ordered=True) == []


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_gpu_decode_block_holds_no_second_contiguous_cache(kernel):
    """On an H100 a decode block over a contiguous cache keeps each run's cache stacked: its
    temporaries stay under the cache's bytes (split into per-layer buffers, as XLA:CPU's block
    holds it, they were a whole second cache: `Platform.buffers_apart`)."""
    _, _, cache, temp = program("h100", kernel, 0)
    assert temp < sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache))


@pytest.mark.parametrize("page_size", [0, PAGE_SIZE])
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_decode_block_loops_a_known_number_of_times(kernel, page_size):
    """On an H100 every loop of a decode block, the block's own and the grouped GEMMs', has a trip
    count XLA knows (`known_trip_count`): the GPU runtime runs it without reading its condition."""
    hlo, *_ = program("h100", kernel, page_size)
    assert re.search(r" while\(", hlo) and loops_of_unknown_trip_count(hlo) == []


@pytest.mark.parametrize("rows", [12, 300])  # a decode step's (one product per row) and a prefill's (a loop of tiles)
@pytest.mark.parametrize("fmt", ["unquantized", "nvfp4"])
def test_the_xla_grouped_gemm_loops_a_known_number_of_times_on_a_gpu(fmt, rows):
    """The XLA grouped GEMM compiled for an H100: no loop over the touched groups (its trip count
    computed on the device), whatever the rows and the experts' format."""
    w = jax.ShapeDtypeStruct((16, 256, 192), jnp.bfloat16)
    if fmt != "unquantized":
        w = jax.eval_shape(lambda a: pk.quantize_experts(a, fmt), w)
    f = jax.jit(lambda l, w, s: pk.grouped_gemm(l, w, s, backend="xla", gemm_rows=platform.resolve("cuda").gemm_rows))
    hlo = (
        f.lower(
            on("h100", (rows, 256), jnp.bfloat16),
            jax.tree.map(lambda a: on("h100", a.shape, a.dtype), w),
            on("h100", (16,), jnp.int32),
        )
        .compile()
        .as_text()
    )
    assert loops_of_unknown_trip_count(hlo) == []
