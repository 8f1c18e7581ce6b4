"""grouped_gemm's numbers: the XLA path against numpy, on XLA:CPU and as accelerators run it; the
Pallas kernels (interpreted) against the XLA path. (Compiled programs: `test_kernels_compiled.py`.)"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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
from moejax.base.platform import resolve
from moejax.model.layers import silu_glu
from pallas_kernels.layered import LayerOf
from pallas_kernels.registry import gemm_tiles


@pytest.mark.parametrize("fmt", ["dense", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("scenario", ["ragged", "one_group", "offset"])
@pytest.mark.parametrize("m", ROWS)
def test_xla_matches_numpy(fmt, scenario, m):
    lhs, rhs, sizes, offset = make_case(
        0, scenario, jnp.float32, m=m, n=48, groups=8, local=3 if scenario == "offset" else None
    )
    w, w_f32 = weights(rhs, fmt, jnp.float32)
    out = pk.grouped_gemm(lhs, w, sizes, group_offset=offset, backend="xla")
    expected = reference(lhs, w_f32, sizes, offset)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[int(sizes.sum()) :], 0.0)  # rows past the sum


def test_xla_bf16_traced_offset_and_out_dtype():
    lhs, rhs, sizes, _ = make_case(1, "ragged", jnp.bfloat16, m=33, n=32, groups=8)
    w = rhs[2:6].astype(jnp.bfloat16)
    f = jax.jit(lambda l, w, s, o: pk.grouped_gemm(l, w, s, group_offset=o, preferred_element_type=jnp.float32))
    out = f(lhs, w, sizes, jnp.int32(2))
    assert out.dtype == jnp.float32 and pk.grouped_gemm(lhs, w, sizes).dtype == jnp.bfloat16
    np.testing.assert_allclose(out, reference(lhs, w.astype(jnp.float32), sizes, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", ROWS)
def test_xla_reads_only_touched_groups(m):
    """Weights of empty groups may hold NaN: they must never enter the result."""
    lhs, rhs, sizes, _ = make_case(2, "ragged", jnp.float32, m=m, n=32, groups=8)
    poisoned = jnp.where((sizes == 0)[:, None, None], jnp.nan, rhs)
    out = pk.grouped_gemm(lhs, poisoned, sizes, backend="xla")
    np.testing.assert_allclose(out, reference(lhs, rhs, sizes, 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt,act", [("dense", None), ("nvfp4", None), ("nvfp4", "swiglu")])
def test_gpu_kernel_reads_a_layer_of_a_stack(fmt, act):
    """One layer of a stack [L, G, K, N] (LayerOf) through the Triton kernel (interpreted), local
    groups at an offset: the result of the layer as its own array (its weights, block scales,
    tensor scales and, NVFP4 gate|up, column scales: each layer's its own)."""
    lhs, rhs, sizes, offset = make_case(9, "offset", jnp.float32, m=40, n=48, groups=6, local=3)
    stack = jnp.stack([rhs * 2, rhs, rhs * 3])  # [3, G, K, N]
    w = stack if fmt == "dense" else pk.quantize_experts(stack, fmt, gated=act is not None)
    bias = jnp.asarray(np.random.default_rng(3).standard_normal((3, 48)), jnp.float32)
    run = jax.jit(
        lambda w: pk.grouped_gemm(
            lhs, w, sizes, group_offset=offset, bias=bias, act=GLU_ACTS.get(act), backend="interpret_triton"
        )
    )
    np.testing.assert_array_equal(run(LayerOf(w, jnp.int32(1))), run(jax.tree.map(lambda a: a[1], w)))


def test_xla_decode_and_prefill_chunking():
    """One row per group (decode) and many rows per group (prefill, full + power-of-2 chunks)."""
    for m, sizes in [(8, [1, 0, 1, 1, 0, 1, 2, 1]), (600, [300, 0, 1, 150, 149, 0, 0, 0])]:
        lhs, rhs, _, _ = make_case(3, "ragged", jnp.float32, m=m, n=16, k=64, groups=8)
        sizes = jnp.asarray(sizes, jnp.int32)
        out = pk.grouped_gemm(lhs, rhs, sizes, backend="xla")
        np.testing.assert_allclose(out, reference(lhs, rhs, sizes, 0), rtol=1e-4, atol=1e-4)


# The XLA path as an accelerator runs it (`moejax.base.platform.Platform.gemm_rows`): a decode step's few rows a
# product each (one gather on a GPU, a slice per row on a TPU), a prefill's many in a loop of tiles.
ACCELERATORS = ["gpu", "tpu"]


@pytest.mark.parametrize("platform", ACCELERATORS)
@pytest.mark.parametrize("fmt", ["dense", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("m", [12, 300])
def test_xla_on_accelerators_matches_numpy(platform, fmt, m):
    """Layer 1 of a stack (`LayerOf`), local groups at an offset: the layer's product; rows of other
    groups and past the last zero (tests/test_target_structure.py: no loop whose trip count
    depends on the picks, compiled for an H100)."""
    lhs, rhs, sizes, offset = make_case(
        zlib.crc32(f"{platform}/{fmt}/{m}".encode()), "offset", jnp.float32, m=m, n=48, groups=8, local=3
    )
    w, w_f32 = weights(jnp.stack([rhs * 2, rhs]), fmt, jnp.float32)
    f = jax.jit(
        lambda l, w, s, i: pk.grouped_gemm(
            l, LayerOf(w, i), s, group_offset=offset, backend="xla", gemm_rows=resolve(platform).gemm_rows
        )
    )
    out = f(lhs, w, sizes, jnp.int32(1))
    np.testing.assert_allclose(out, reference(lhs, w_f32[1], sizes, offset), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[int(sizes.sum()) :], 0.0)


@pytest.mark.parametrize("platform", ACCELERATORS)
@pytest.mark.parametrize("tokens", [3, 40])  # 12 picks, one product each; 160, in tiles
def test_xla_on_accelerators_finishes_products_as_the_loop(platform, tokens):
    """A gate|up product of each pick's token row (bias, activation) and the down product summed into
    the tokens (bias, weights) as an accelerator runs them: XLA:CPU's group loop's results."""
    lhs, w, sizes, offset, combine, bias, expected = picks_case(tokens, tokens, "nvfp4")
    run = functools.partial(pk.grouped_gemm, lhs, w, sizes, group_offset=offset, bias=bias, backend="xla")
    np.testing.assert_allclose(
        run(combine=combine, gemm_rows=resolve(platform).gemm_rows), expected, rtol=1e-5, atol=1e-5
    )
    up, w_up, up_sizes, up_offset, up_bias = glu_case("nvfp4", jnp.float32, n=96)
    rows = jnp.asarray(np.random.default_rng(tokens).integers(0, up.shape[0], 4 * tokens), jnp.int32)
    up_sizes = jnp.asarray(np.random.default_rng(1).multinomial(4 * tokens, np.ones(6) / 6), jnp.int32)
    glu = functools.partial(
        pk.grouped_gemm,
        up,
        w_up,
        up_sizes,
        group_offset=up_offset,
        bias=up_bias,
        act=silu_glu,
        lhs_rows=rows,
        backend="xla",
    )
    np.testing.assert_allclose(glu(gemm_rows=resolve(platform).gemm_rows), glu(), rtol=1e-5, atol=1e-5)


# Each kernel sees every format, both dtypes and every scenario, spread over six cases.
KERNEL_CASES = [
    ("dense", jnp.bfloat16, "offset"),
    ("dense", jnp.float32, "one_group"),
    ("nvfp4", jnp.bfloat16, "ragged"),
    ("nvfp4", jnp.float32, "offset"),
    ("mxfp4", jnp.bfloat16, "one_group"),
    ("mxfp4", jnp.float32, "ragged"),
]


@pytest.mark.parametrize("backend", list(KERNELS))
@pytest.mark.parametrize("fmt,dtype,scenario", KERNEL_CASES)
def test_pallas_kernel_matches_xla(backend, fmt, dtype, scenario):
    seed = zlib.crc32(f"{backend}/{fmt}/{scenario}".encode())  # fresh inputs per case
    lhs, rhs, sizes, offset = make_case(seed, scenario, dtype, local=3 if scenario == "offset" else None)
    w, _ = weights(rhs, fmt, dtype)
    out = pk.grouped_gemm(lhs, w, sizes, group_offset=offset, backend=backend)
    expected = pk.grouped_gemm(lhs, w, sizes, group_offset=offset, backend="xla")
    assert out.shape == expected.shape and out.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), **tolerance(dtype))
    np.testing.assert_array_equal(np.asarray(out, np.float32)[int(sizes.sum()) :], 0.0)


@pytest.mark.parametrize("backend", ["xla", *KERNELS])
def test_column_tensor_scales_of_a_gate_up_stack(backend):
    """NVFP4 gate_up experts carry one tensor scale per half (column-wise [G, 1, N]): every
    backend applies each column's own, as the dequantized weights hold it."""
    lhs, rhs, sizes, offset = make_case(8, "offset", jnp.float32, m=40, n=128, groups=6, local=3)
    w = pk.quantize_experts(rhs * jnp.array([1.0, 40.0] * 64), "nvfp4", gated=True)
    assert w.tensor_scale.shape == (3, 1, 128)
    out = pk.grouped_gemm(lhs, w, sizes, group_offset=offset, backend=backend)
    np.testing.assert_allclose(out, reference(lhs, pk.dequantize(w), sizes, offset), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("backend", list(KERNELS))
@pytest.mark.parametrize("fmt", ["dense", "nvfp4"])
def test_pallas_kernel_accumulates_over_k_tiles(backend, fmt):
    lhs, rhs, sizes, _ = make_case(4, "ragged", jnp.float32, m=20, k=256, n=128)
    w, w_f32 = weights(rhs, fmt, jnp.float32)
    tiles = dataclasses.replace(gemm_tiles(backend, 20, w), tk=64)
    out = jax.jit(lambda l, w, s: KERNELS[backend](l, w, s, 0, jnp.float32, tiles=tiles))(lhs, w, sizes)
    np.testing.assert_allclose(out, reference(lhs, w_f32, sizes, 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", list(KERNELS))
@pytest.mark.parametrize("fmt,dtype,act", GLU_CASES)
def test_glu_epilogue_matches_xla(backend, fmt, dtype, act):
    """A gate|up product with its bias and (clamped) SwiGLU applied in the kernel's epilogue
    equals the XLA path's product, bias and activation (f32: to 1e-5; bf16: the Triton
    epilogue's activation math is f32, XLA's bf16)."""
    lhs, w, sizes, offset, bias = glu_case(fmt, dtype)
    run = functools.partial(pk.grouped_gemm, lhs, w, sizes, group_offset=offset, bias=bias, act=GLU_ACTS[act])
    out, expected = run(backend=backend), run(backend="xla")
    assert out.shape == expected.shape == (lhs.shape[0], w.shape[2] // 2) and out.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), **tolerance(dtype))


@pytest.mark.parametrize("backend", list(KERNELS))
def test_glu_epilogue_writes_half_the_columns(backend):
    """The kernel itself writes [rows, N/2]: the activation is not applied after it."""
    lhs, w, sizes, offset, bias = glu_case("nvfp4", jnp.float32)
    jaxpr = jax.make_jaxpr(
        lambda: pk.grouped_gemm(lhs, w, sizes, group_offset=offset, bias=bias, act=silu_glu, backend=backend)
    )()
    calls = [e for e in jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "pallas_call"]
    assert [c.outvars[0].aval.shape[1] for c in calls] == [w.shape[2] // 2]


# Widths no Triton block (a power of two) divides: (K, N, format, dtype, activation). The Triton
# kernel masks its edge tiles: K 40 in one masked tile of 64, N 24 in one of 32, gate|up N 48 as
# 24 pairs in one tile of 32; NVFP4 K 96 as two K-halves of 48 in one masked tile of 64 (its
# scale blocks masked with them); MXFP4 K 64 (a whole tile) and N 40.
ODD_WIDTHS = [
    (40, 24, "dense", jnp.bfloat16, None),
    (40, 24, "dense", jnp.float32, None),
    (40, 24, "dense", jnp.bfloat16, "swiglu"),
    (40, 48, "dense", jnp.float32, "swiglu"),
    (96, 40, "nvfp4", jnp.bfloat16, "swiglu"),
    (64, 40, "mxfp4", jnp.float32, None),
]


@pytest.mark.parametrize("k,n,fmt,dtype,act", ODD_WIDTHS)
def test_gpu_kernel_takes_any_width(k, n, fmt, dtype, act):
    """The Triton kernel (interpreted) at widths its blocks do not divide equals the XLA path:
    rows over two row tiles, local groups at an offset, a bias and column scales (NVFP4 gate|up:
    a tensor scale per half) in the epilogue; rows of no local group stay zero."""
    lhs, rhs, sizes, offset = make_case(
        zlib.crc32(f"odd/{k}/{n}/{fmt}".encode()), "offset", dtype, m=70, k=k, n=n, local=3
    )
    w = rhs.astype(dtype) if fmt == "dense" else pk.quantize_experts(rhs, fmt, gated=act is not None)
    bias = jnp.asarray(np.random.default_rng(2).standard_normal((3, n)), dtype) if act else None
    run = functools.partial(pk.grouped_gemm, lhs, w, sizes, group_offset=offset, bias=bias, act=GLU_ACTS.get(act))
    out, expected = run(backend="interpret_triton"), run(backend="xla")
    assert out.shape == expected.shape == (70, n // 2 if act else n) and out.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), **tolerance(dtype))
    np.testing.assert_array_equal(np.asarray(out, np.float32)[int(sizes.sum()) :], 0.0)


@pytest.mark.parametrize(
    "fmt,dtype,act", [("dense", jnp.bfloat16, None), ("nvfp4", jnp.float32, "swiglu"), ("mxfp4", jnp.bfloat16, None)]
)
def test_tpu_kernel_reads_a_layer_of_a_stack(fmt, dtype, act):
    """The TPU kernel (interpreted) on layer i of a stack [L, G, K, N] (a `LayerOf`, read where it
    lies) equals the XLA path on that layer at each i: groups at an offset, 4-bit tensor scales
    (NVFP4 gate|up: one per half, column-wise), a bias and the activation in its epilogue."""
    lhs, rhs, sizes, offset = make_case(zlib.crc32(f"stack/{fmt}".encode()), "offset", dtype, local=3)
    stack = jnp.stack([rhs * (1 + i) for i in range(3)])  # [3, 3, K, N]
    w = stack.astype(dtype) if fmt == "dense" else pk.quantize_experts(stack, fmt, gated=act is not None)
    bias = jnp.asarray(np.random.default_rng(3).standard_normal((3, rhs.shape[2])), dtype) if act else None
    run = jax.jit(
        lambda l, w, s, i, backend: pk.grouped_gemm(
            l, LayerOf(w, i), s, group_offset=offset, bias=bias, act=GLU_ACTS.get(act), backend=backend
        ),
        static_argnames="backend",
    )
    for i in (0, 2):
        out, expected = (run(lhs, w, sizes, jnp.int32(i), backend=b) for b in ("interpret_tpu", "xla"))
        assert out.shape == expected.shape and out.dtype == expected.dtype
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), **tolerance(dtype))


@pytest.mark.parametrize("backend", ["xla", *KERNELS])
@pytest.mark.parametrize("fmt", ["dense", "nvfp4"])
@pytest.mark.parametrize(
    "tokens", [3, 40]
)  # a decode step's few picks, a prefill's many (the XLA loop sums them itself)
def test_combine_sums_each_tokens_weighted_picks(backend, fmt, tokens):
    """A down product with combine: each token's picks of local experts, plus their bias,
    weighted and summed into the token's row; picks of other experts add nothing."""
    lhs, w, sizes, offset, combine, bias, expected = picks_case(
        zlib.crc32(f"{backend}/{fmt}/{tokens}".encode()), tokens, fmt
    )
    out = pk.grouped_gemm(lhs, w, sizes, group_offset=offset, bias=bias, combine=combine, backend=backend)
    assert out.shape == expected.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_auto_backend_and_bad_names():
    lhs, rhs, sizes, _ = make_case(5, "ragged", jnp.float32, m=16, n=64, k=64)
    assert jax.default_backend() == "cpu"
    np.testing.assert_array_equal(pk.grouped_gemm(lhs, rhs, sizes), pk.grouped_gemm(lhs, rhs, sizes, backend="xla"))
    with pytest.raises(ValueError, match="unknown grouped_gemm backend"):
        pk.grouped_gemm(lhs, rhs, sizes, backend="cuda")
    with pytest.raises(ValueError, match="axis=-2"):
        pk.grouped_gemm(lhs, pk.quantize(jnp.swapaxes(rhs, 1, 2), "nvfp4", axis=-1), sizes)
