"""Decode programs as accelerators compile them (compile-only devices, `moejax.base.targets`): a block
of decode steps (`engine.decode_steps`, what `generate` runs) copies no layer of a run's stacked
experts or page pool out of its stack, and holds no loop whose trip count the compiler does not
know (XLA:GPU reads such a loop's condition back to the host on every iteration)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from compile_only import lower, on

import pallas_kernels as pk
from moejax.analysis import layer_ops
from moejax.base import platform, targets
from moejax.compiled import hlo, plan
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
STEPS = EngineConfig().decode_block  # a decode block's
KERNELS = ("xla", "auto")  # auto on h100: mosaic_gpu (bf16), triton (float32); on v5e: pallas_tpu


def scoped(text: str, scope: str) -> list[hlo.Run]:
    """The kernels a program launches under a named scope ("grouped_gemm", "/attention/"): what a
    check that finds no copy among them has looked through."""
    return [r for r in hlo.launches(text) if scope in r.instr.scope]


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
    compiled = lower(jitted, *args).compile()
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
    text, params, cache, _ = program(target, kernel, page_size)
    shapes = [s for run in params["layers"] for s in layer_shapes(layer(run)["moe"]["experts"])]
    if page_size:
        shapes += [s for run in cache for s in layer_shapes(layer(run))]
    assert scoped(text, "/experts/") and scoped(text, "/attention/")
    assert hlo.writes_of(text, shapes) == []


@pytest.mark.parametrize("page_size", [0, PAGE_SIZE])
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_gpu_reads_every_weight_of_a_layer_where_it_lies(kernel, page_size):
    """On an H100 a decode block writes no array of any layer weight's shape (attention, router,
    norms and experts), nor over pages of a layer's pool: its runs of layers are unrolled
    (`Platform.unrolls`), each layer's weights buffers of their own, where a scan's slice of the
    attention and router weights is a copy XLA:GPU makes before every GEMM. (A contiguous cache is
    split into its layers' buffers once a block and written in place: `kv_cache.per_layer`.)"""
    text, params, cache, _ = program("h100", kernel, page_size)
    shapes = [s for run in params["layers"] for s in layer_shapes(layer(run))]
    if page_size:
        shapes += [s for run in cache for s in layer_shapes(layer(run))]
    assert all(scoped(text, f"/{part}/") for part in ("qkv", "out", "router", "experts"))
    assert hlo.writes_of(text, shapes, ordered=True) == []


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
    text, *_ = program("h100", kernel, page_size)
    loops = hlo.loops(text)
    assert [hlo.known_trip_count(r.instr) for r in loops if r.computation == hlo.parse(text).entry] == [STEPS]
    assert [r.instr.name for r in loops if hlo.known_trip_count(r.instr) is None] == []


@pytest.mark.parametrize("rows", [12, 300])  # a decode step's (one product per row) and a prefill's (a loop of tiles)
@pytest.mark.parametrize("fmt", ["unquantized", "nvfp4"])
def test_the_xla_grouped_gemm_loops_a_known_number_of_times_on_a_gpu(fmt, rows):
    """The XLA grouped GEMM compiled for an H100: no loop over the touched groups (its trip count
    computed on the device), whatever the rows and the experts' format."""
    w = jax.ShapeDtypeStruct((16, 256, 192), jnp.bfloat16)
    if fmt != "unquantized":
        w = jax.eval_shape(lambda a: pk.quantize_experts(a, fmt), w)
    f = jax.jit(lambda l, w, s: pk.grouped_gemm(l, w, s, backend="xla", gemm_rows=platform.resolve("cuda").gemm_rows))
    text = (
        lower(
            f,
            on("h100", (rows, 256), jnp.bfloat16),
            jax.tree.map(lambda a: on("h100", a.shape, a.dtype), w),
            on("h100", (16,), jnp.int32),
        )
        .compile()
        .as_text()
    )
    loops = hlo.loops(text)
    assert bool(loops) == (rows > 16) and scoped(text, "grouped_gemm")  # the loop of tiles: a prefill's
    assert [r.instr.name for r in loops if hlo.known_trip_count(r.instr) is None] == []


def test_a_gpu_decode_block_launches_each_kernel_of_its_steps():
    """The launches of an H100 decode block of STEPS steps over 4 MoE layers: its loop's body's
    kernels STEPS times each, its condition's none (XLA:GPU knows its trip count), and each layer's 6
    Mosaic GPU kernels a step (a Hopper's decode set: the fused q|k|v and output projections, the
    router with its norm and top-k, the experts' gate_up and down by pick, and the paged attention),
    with the combines of the 3 that split K at 8 rows to fill an H100's SMs (q|k|v, output:
    `pallas_kernels/linear_mgpu.py`; the router: `route_mgpu.py`), and no Triton kernel."""
    text, *_ = program("h100", "auto", PAGE_SIZE)
    launches = hlo.launches(text)
    (loop,) = hlo.loops(text)
    body = [r for r in launches if r.computation == loop.instr.called("body")]
    assert len(hlo.parse(text).runs) > 250 and len(body) > 4 * 10  # about 15 kernels a layer
    assert {r.count for r in body} == {STEPS} and not [r for r in launches if r.condition_of is not None]
    kinds = hlo.by_kind(launches)
    assert "custom-call __gpu$xla.gpu.triton" not in kinds, kinds
    assert kinds["custom-call mosaic_gpu_v2"] == STEPS * 4 * (6 + 3)
    assert sum(kinds.values()) == sum(r.count for r in launches)


def test_a_tpu_decode_block_runs_each_layers_router_and_experts_as_a_kernel_each():
    """On one v5e `auto`'s decode steps run a layer's MoE as two Mosaic calls of its decode set, the
    router (`route_tpu`: norm, logits, top-k, weights and the experts' slot table) and the experts
    (`expert_ffn_tpu`), with nothing sorted, scattered or gathered beside them: XLA's router and the
    grouped GEMM's path were some ninety ops a layer, XLA's slot table six, the experts' layer in
    their stack a multiply."""
    text, *_ = program("v5e", "auto", PAGE_SIZE)
    moe = scoped(text, "/moe/")
    for part in ("/router", "/experts"):
        kernels = [r for r in moe if part in r.instr.scope and r.instr.pallas]
        assert sum(r.count for r in kernels) == STEPS * MODEL.num_layers, part
    assert not [r.instr.name for r in moe if r.instr.opcode in ("sort", "scatter", "gather")]
    assert sum(r.count for r in moe) == STEPS * MODEL.num_layers * 2  # the two alone


# A v5e layer of Qwen3-30B-A3B's decode step at batch 1, synchronous ops (docs/design.md's table): the
# five kernels, the page write and its indices, the attention's table and metadata, the layer loop's own.
V5E_OPS_PER_LAYER = 19


def test_a_v5e_layer_of_qwen3_30b_runs_its_moe_as_two_kernels_in_few_ops():
    """Qwen3-30B-A3B's decode step on one v5e at batch 1 over 4,096 positions, a layer of it
    (`layer_ops`: the steps of 4 and 3 layers less one another): q|k|v (with the input norm, head
    norms and rotary), the paged attention, the output projection (with the residual), the router
    (with the experts' slot table) and the experts, five Mosaic calls; nothing sorted; q|k|v and the
    output projection their calls alone (q as heads [M, H, Dh] and k|v as the page pool's interleaved
    rows from the one, attention's heads read as they lie by the other: no relayout between them); at
    most V5E_OPS_PER_LAYER synchronous ops (batch 64: `moejax plan`, docs/design.md)."""
    config = Config(
        model=preset("qwen3-moe-30b-a3b"),
        layout=LayoutConfig(devices=1),
        weights=WeightsConfig("unquantized"),
        engine=EngineConfig(dtype="bfloat16"),
    ).validate()
    ops = layer_ops.layer_ops(config, 1, 4096, targets.target("v5e"), list(targets.devices("v5e", 1)), 16)
    assert ops["groups"]["sorts"] == 0, ops
    mosaic = [p for p in ops["parts"] if p["kind"] == "custom-call tpu_custom_call"]
    assert sum(p["ops"] for p in mosaic) == 5 and {p["part"] for p in mosaic} == {
        "attention/qkv",
        "attention/ragged_paged_attention_kernel",
        "attention/out",
        "moe/router",
        "moe/experts",
    }
    dense = [p for p in ops["parts"] if p["part"] in ("attention/qkv", "attention/out")]
    assert [p["kind"] for p in dense] == ["custom-call tpu_custom_call"] * 2, dense
    assert ops["ops"] <= V5E_OPS_PER_LAYER, ops
