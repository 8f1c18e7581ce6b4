"""grouped_gemm compiled: the XLA path's programs write no copy of a stack's groups and no
product they finish in the loop (`moejax.compiled.hlo` reads them); the Pallas kernels compile for
their hardware (Triton for an H100, Mosaic for a v5e)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_only import lower, on, on_h100
from gemm_cases import (
    GLU_ACTS,
    GLU_CASES,
    KERNELS,
    ROWS,
    glu_case,
    make_case,
    picks_case,
    reference,
    tolerance,
    weights,
)

import pallas_kernels as pk
from moejax.base import targets
from moejax.compiled import hlo
from moejax.compiled.plan import decode_program
from moejax.config import Config, EngineConfig, LayoutConfig, preset
from moejax.model.layers import silu_glu
from pallas_kernels import epilogue
from pallas_kernels.layered import LayerOf, split

# Each target's grouped-GEMM kernel and the compiler of the Pallas call it compiles to (`hlo.PALLAS`).
TARGET_KERNELS = {"v5e": ("pallas_tpu", "mosaic_tpu"), "h100": ("triton", "triton")}
# A stack's groups [G, K, N] (6, 128, 80), dense or 4-bit ([G, K/2, N] packed values).
GROUPS = [(6, 128, 80), (6, 64, 80)]


def kernel_calls(text: str, target: str) -> list[hlo.Run]:
    """The launches of a compiled program calling `target`'s grouped-GEMM kernel (`TARGET_KERNELS`)."""
    return [r for r in hlo.pallas_calls(text) if r.instr.pallas == TARGET_KERNELS[target][1]]


@pytest.mark.parametrize("fmt", ["dense", "nvfp4"])
def test_xla_never_converts_all_groups(fmt):
    """Compiled, its products read the groups they touch: no op writes a [G, K, N] array (a convert
    or decode of every group hoisted out of the group loop, which XLA:CPU would otherwise make
    and so read every group's weights on every call)."""
    w = jax.ShapeDtypeStruct((6, 128, 80), jnp.bfloat16)  # [G, K, N], distinctive dims
    if fmt != "dense":
        w = jax.eval_shape(lambda a: pk.quantize(a, fmt), w)
    text = (
        jax.jit(lambda l, w, s: pk.grouped_gemm(l, w, s, backend="xla"))
        .lower(jax.ShapeDtypeStruct((16, 128), jnp.bfloat16), w, jax.ShapeDtypeStruct((6,), jnp.int32))
        .compile()
        .as_text()
    )
    assert hlo.products(text) and hlo.writes_of(text, GROUPS, ordered=True) == []


@pytest.mark.parametrize("fmt", ["dense", "nvfp4"])
@pytest.mark.parametrize("m", ROWS)
def test_xla_reads_groups_of_a_layer_stack(fmt, m):
    """One layer of a stack [L, G, K, N] (LayerOf): the layer's result, and compiled, no
    [G, K, N] copy of the layer (XLA:CPU copies a sliced layer whole before the group loop)."""
    lhs, rhs, sizes, _ = make_case(7, "ragged", jnp.float32, m=m, n=80, groups=6)
    stack = jnp.stack([rhs * 2, rhs])  # [2, G, K, N]
    w, w_f32 = weights(stack, fmt, jnp.float32)
    f = jax.jit(lambda l, w, s, i: pk.grouped_gemm(l, LayerOf(w, i), s, backend="xla"))
    np.testing.assert_allclose(f(lhs, w, sizes, jnp.int32(1)), reference(lhs, w_f32[1], sizes, 0), rtol=1e-5, atol=1e-5)
    text = f.lower(lhs, w, sizes, jnp.int32(1)).compile().as_text()
    assert hlo.products(text) and hlo.writes_of(text, GROUPS, ordered=True) == []


def test_gpu_decode_step_copies_no_layer_of_experts():
    """A scanned run's decode step on an H100 (engine.layer_loop scan) hands the Triton kernels (a decode
    step's rows: by pick; named: `auto` takes Mosaic GPU's, which refuse this model's widths) each
    layer's experts where they lie in the run's stack [L, E, K, N]: no instruction of the compiled step
    makes an array of one layer's [E, K, N] (a dynamic-slice fusion copied each layer out of the stack
    every step)."""
    model = dataclasses.replace(preset("tiny-qwen3-moe"), num_layers=4)  # a run of 2 identical MoE layers
    config = Config(
        model=model,
        layout=LayoutConfig(devices=1),
        engine=EngineConfig(dtype="bfloat16", layer_loop="scan"),
        kernel="triton",
    )
    placement, step, args = decode_program(config.validate(), 8, 64, "cuda", devices=list(targets.devices("h100", 1)))
    stacks = [a.shape for run in args[0]["layers"] if "moe" in run for a in run["moe"]["experts"].values()]
    assert placement.decode.kernel == "triton" and max(shape[0] for shape in stacks) == 2
    text = lower(jax.jit(step), *args).compile().as_text()
    gemms = [r for r in kernel_calls(text, "h100") if "experts" in r.instr.scope]
    assert sum(r.count for r in gemms) == sum(shape[0] for shape in stacks)  # gate_up and down, each layer
    assert hlo.writes_of(text, [shape[1:] for shape in stacks], ordered=True) == []


@pytest.mark.parametrize("fmt", ["dense", "nvfp4"])
@pytest.mark.parametrize("m", ROWS)
def test_xla_multiplies_groups_held_a_buffer_each(fmt, m):
    """A layer held a buffer per group (`Groups`): the stack's result; and row at a time (12 rows
    over 6 groups), no group's [K, N] is copied out of its buffer before its products."""
    lhs, rhs, sizes, _ = make_case(8, "ragged", jnp.float32, m=m, n=80, groups=6)
    w, w_f32 = weights(rhs, fmt, jnp.float32)
    groups = jax.jit(split)(w)  # a buffer per group, as an engine holds them
    f = jax.jit(lambda l, w, s: pk.grouped_gemm(l, w, s, backend="xla"))
    np.testing.assert_allclose(f(lhs, groups, sizes), reference(lhs, w_f32, sizes, 0), rtol=1e-5, atol=1e-5)
    if fmt == "dense" and m < 6 * 4:
        text = f.lower(lhs, groups, sizes).compile().as_text()
        assert hlo.products(text)  # any number of groups' [K, N]: a group's, or a stack of them
        assert hlo.writes_of(text, [(g, 128, 80) for g in range(1, 7)], ordered=True) == []


@pytest.mark.parametrize(
    "k,n,fmt,act", [(40, 24, "dense", None), (40, 48, "dense", "swiglu"), (96, 40, "nvfp4", "swiglu")]
)
def test_gpu_kernel_compiles_for_h100_at_any_width(k, n, fmt, act):
    """Triton takes only power-of-two blocks: the kernel compiles for an H100 at widths none
    divides (whole-width tiles were refused: "Encountered an array of shape (32, 40)")."""
    w = on_h100((8, k, n), jnp.bfloat16)
    if fmt != "dense":
        w = jax.tree.map(
            lambda a: on_h100(a.shape, a.dtype),
            jax.eval_shape(lambda a: pk.quantize_experts(a, fmt, gated=act is not None), w),
        )
    f = jax.jit(
        lambda l, w, s, o, b: pk.grouped_gemm(l, w, s, group_offset=o, bias=b, act=GLU_ACTS.get(act), backend="triton")
    )
    text = (
        lower(
            f,
            on_h100((12, k), jnp.bfloat16),
            w,
            on_h100((8,), jnp.int32),
            on_h100((), jnp.int32),
            on_h100((8, n), jnp.bfloat16) if act else None,
        )
        .compile()
        .as_text()
    )
    assert len(kernel_calls(text, "h100")) == 1 and hlo.writes_of(text, [(12, n // 2 if act else n)], ordered=True)


@pytest.mark.parametrize("fmt,dtype,act", GLU_CASES)
def test_xla_loop_activates_each_chunk_without_writing_the_product(fmt, dtype, act):
    """The XLA group loop finishes each chunk (its group's bias) and applies the activation as it
    goes: the [M, N/2] of the product with bias and activation applied after it, and no [M, N]."""
    lhs, w, sizes, offset, bias = glu_case(fmt, dtype)
    m, n = lhs.shape[0], w.shape[2]
    run = jax.jit(
        lambda: pk.grouped_gemm(lhs, w, sizes, group_offset=offset, bias=bias, act=GLU_ACTS[act], backend="xla")
    )
    product = pk.grouped_gemm(lhs, w, sizes, group_offset=offset, backend="xla")
    expected = epilogue.glu(
        *epilogue.gate_up_columns(epilogue.finish(product, dtype, None, epilogue.group_rows(bias, sizes, offset, m))),
        GLU_ACTS[act],
    )
    assert run().dtype == dtype
    np.testing.assert_allclose(
        np.asarray(run(), np.float32),
        np.asarray(expected, np.float32),
        **(tolerance(dtype) if dtype == jnp.bfloat16 else dict(rtol=1e-6, atol=1e-6)),
    )
    text = run.lower().compile().as_text()
    assert hlo.writes_of(text, [(m, n // 2)], ordered=True) and hlo.writes_of(text, [(m, n)]) == []


@pytest.mark.parametrize("backend", ["xla", *KERNELS])
@pytest.mark.parametrize("m", ROWS)
def test_lhs_rows_reads_each_rows_token(backend, m):
    """lhs_rows: a gate|up product (bias, activation) of rows lhs[lhs_rows] without the caller
    gathering them; the XLA loop gathers each chunk's rows, never the [M, K] they make."""
    lhs, w, sizes, offset, bias = glu_case("dense", jnp.float32)
    tokens = lhs[:9]  # [T, K]: rows repeat, as a token's k picks do
    lhs_rows = jnp.asarray(np.random.default_rng(m).integers(0, 9, m), jnp.int32)
    sizes = jnp.asarray(np.random.default_rng(0).multinomial(m, np.ones(sizes.shape[0]) / sizes.shape[0]), jnp.int32)
    run = jax.jit(
        lambda x, r: pk.grouped_gemm(
            x, w, sizes, group_offset=offset, bias=bias, act=silu_glu, lhs_rows=r, backend=backend
        )
    )
    expected = pk.grouped_gemm(
        tokens[lhs_rows], w, sizes, group_offset=offset, bias=bias, act=silu_glu, backend=backend
    )
    np.testing.assert_allclose(run(tokens, lhs_rows), expected, rtol=1e-6, atol=1e-6)
    if backend == "xla" and m > 16:  # the group loop (few rows take one batched product)
        text = run.lower(tokens, lhs_rows).compile().as_text()
        assert hlo.loops(text) and hlo.writes_of(text, [(m, lhs.shape[1])]) == []


@pytest.mark.parametrize("as_groups", [False, True])  # a layer's stack, or a buffer per group (row at a time)
def test_xla_loop_sums_picks_without_writing_the_product(as_groups):
    """The XLA loop adds each chunk into its tokens' rows: no [T*k, N] buffer in its program,
    and the same sums as the product followed by `epilogue.combine`."""
    lhs, w, sizes, offset, combine, bias, _ = picks_case(5, 40, "dense")
    rhs = split(w) if as_groups else w
    run = jax.jit(lambda l, r, s, c, b: pk.grouped_gemm(l, r, s, group_offset=offset, bias=b, combine=c, backend="xla"))
    text = run.lower(lhs, rhs, sizes, combine, bias).compile().as_text()
    assert hlo.writes_of(text, [(40, w.shape[2])]) and hlo.writes_of(text, [(lhs.shape[0], w.shape[2])]) == []
    unfused = pk.grouped_gemm(lhs, w, sizes, group_offset=offset, bias=bias, backend="xla")
    np.testing.assert_allclose(
        run(lhs, rhs, sizes, combine, bias), epilogue.combine(unfused, *combine), rtol=1e-5, atol=1e-5
    )


def target_gemm(target: str, fmt: str, m: int = 256, k: int = 2048, n: int = 512, act=None):
    """One grouped GEMM [m, k] x [8, k, n] lowered for a compile-only device of `target` with its
    kernel ("nvfp4 gate_up": a gate_up stack's tensor scales, one per half; act: a gate|up
    product's activation, with a bias, in the epilogue)."""
    backend = TARGET_KERNELS[target][0]
    w = jax.ShapeDtypeStruct((8, k, n), jnp.bfloat16)
    if fmt != "dense":
        w = jax.eval_shape(lambda a: pk.quantize_experts(a, fmt.split()[0], gated=fmt.endswith("gate_up")), w)
    w = jax.tree.map(lambda a: on(target, a.shape, a.dtype), w)
    bias = jnp.zeros((8, n), jnp.bfloat16) if act is not None else None
    f = jax.jit(lambda l, w, s, o: pk.grouped_gemm(l, w, s, group_offset=o, backend=backend, bias=bias, act=act))
    return lower(f, on(target, (m, k), jnp.bfloat16), w, on(target, (32,), jnp.int32), on(target, (), jnp.int32))


@pytest.mark.parametrize("target", list(TARGET_KERNELS))
@pytest.mark.parametrize("fmt", ["dense", "nvfp4", "mxfp4", "nvfp4 gate_up"])
def test_hardware_kernels_compile_for_their_targets(target, fmt):
    """The kernels compile for their hardware (Mosaic TPU / Triton) at production-like sizes;
    "gate_up": NVFP4 with a tensor scale per half (column-wise)."""
    assert kernel_calls(target_gemm(target, fmt).compile().as_text(), target)


@pytest.mark.parametrize("target", list(TARGET_KERNELS))
@pytest.mark.parametrize("act", list(GLU_ACTS))
def test_glu_epilogue_compiles_for_its_target(target, act):
    """The kernels with the activation in their epilogue compile for their hardware, writing
    [rows, N/2] (a gate_up stack of Qwen3-30B-A3B's width, F = 768, NVFP4)."""
    lowered = target_gemm(target, "nvfp4 gate_up", n=1536, act=GLU_ACTS[act])
    assert "tensor<256x768xbf16>" in lowered.as_text()
    assert kernel_calls(lowered.compile().as_text(), target)


@pytest.mark.parametrize("fmt,k", [("nvfp4", 256), ("nvfp4", 512), ("nvfp4", 768), ("mxfp4", 512)])
def test_tpu_kernel_takes_k_whose_scale_rows_fill_no_tile(fmt, k):
    """Where no K tile's scale rows fill Mosaic's 32-row tile of 8-bit data (a tensor-sliced
    expert's K of 256 on 8 devices), K is one step and its scale rows one block: it compiles for a
    v5e and, interpreted, gives the XLA path's products."""
    assert kernel_calls(target_gemm("v5e", fmt, m=64, k=k, n=512).compile().as_text(), "v5e")
    lhs = jax.random.normal(jax.random.key(0), (40, k), jnp.float32)
    rhs = pk.quantize_experts(jax.random.normal(jax.random.key(1), (4, k, 256), jnp.float32), fmt)
    sizes = jnp.array([10, 0, 20, 10], jnp.int32)
    np.testing.assert_allclose(
        pk.grouped_gemm(lhs, rhs, sizes, backend="interpret_tpu"),
        pk.grouped_gemm(lhs, rhs, sizes, backend="xla"),
        rtol=1e-5,
        atol=1e-4,
    )


def test_tpu_kernel_tells_xla_its_cost():
    """The pallas_call carries a cost estimate, as megablox's does, so XLA can schedule around it."""
    [call] = kernel_calls(target_gemm("v5e", "dense", m=256, k=2048, n=512).compile().as_text(), "v5e")
    cost = json.loads(call.instr.backend_config)["custom_call_config"]["cost_estimate"]
    assert int(cost["flops"]) == 2 * 256 * 2048 * 512
