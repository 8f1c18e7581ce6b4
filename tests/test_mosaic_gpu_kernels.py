"""The Hopper grouped GEMM on Mosaic GPU (`gmm_mosaic_gpu`) without a GPU: jax's Mosaic GPU
interpreter runs it against float64 numpy; jax's Mosaic GPU lowering and XLA:GPU compile it for a
compile-only H100. Its PTX is compiled and run only where a GPU loads it (tests/test_gpu.py)."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_only import on_h100

import pallas_kernels as pk
from moejax.compiled import hlo
from moejax.model.layers import ClampedSwiGLU, silu_glu
from pallas_kernels.gmm_mosaic_gpu import gmm_mosaic_gpu, refusal
from pallas_kernels.layered import LayerOf
from pallas_kernels.registry import gemm_tiles

ACTS = {"swiglu": silu_glu, "clamped_swiglu": ClampedSwiGLU(alpha=1.702, limit=7.0)}
GROUPS, LOCAL, LAYERS, ROWS = 6, 3, 2, 70


@dataclasses.dataclass(frozen=True)
class Case:
    """A grouped GEMM of ROWS bf16 rows over LOCAL of GROUPS groups: experts [LOCAL, k, n] in `fmt`
    (a gate|up stack through `act` with a bias; `gated`: quantized as one, NVFP4 with a tensor scale
    per half), one layer of a stack of LAYERS when `layer`."""

    fmt: str
    k: int
    n: int
    act: str | None = None
    gated: bool = False
    layer: bool = False
    out_dtype: str = "float32"
    tk: int | None = None
    steps: int = 3


def tiles(rows: int, rhs, gated: bool = False, **chosen):
    """The tiles the registry hands the kernel for `rows` rows of rhs, but the case's `chosen` ones."""
    return dataclasses.replace(gemm_tiles("mosaic_gpu", rows, rhs, gated), **{k: v for k, v in chosen.items() if v})


# Every case has rows over two row tiles, groups before the local ones, an empty local group and
# trailing rows of no group. Pipelines that refill their stages (bf16: 4 K steps in 3 stages, two
# N tiles; NVFP4: 3 K steps of two K-halves in 2 stages, its decoded tiles' two buffers reused);
# widths no tile divides (K 44 padded to TMA's 16-byte rows, N 40 of a 4-bit expert padded; a 4-bit
# K/2 of 48 or 32 in a tile of 64: its codes past K/2 read zero); a layer of a stack read where it
# lies; the epilogue's tensor scales (NVFP4's per group, or per column of a gate|up stack), bias
# and (clamped) SwiGLU.
CASES = {
    "bf16": Case("dense", 256, 256, tk=64),
    "nvfp4 gate_up of a layer": Case(
        "nvfp4", 384, 256, "swiglu", gated=True, layer=True, out_dtype="bfloat16", steps=2
    ),
    "mxfp4 odd widths": Case("mxfp4", 64, 40),
    "nvfp4 odd widths, clamped SwiGLU": Case("nvfp4", 96, 40, "clamped_swiglu"),
    "bf16 gate_up of a layer, odd widths": Case("dense", 44, 48, "clamped_swiglu", layer=True, out_dtype="bfloat16"),
}


def make_operands(case: Case):
    """(lhs [ROWS, K] bf16, rhs, group_sizes [GROUPS], group_offset, epilogue, w [LOCAL, K, N] f64)
    for `gmm_mosaic_gpu`, as the registry hands them to a kernel: 4-bit gate|up tensor scales,
    one per column, go to the epilogue and the weights carry none."""
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    sizes = np.array([9, 4, 21, 0, 25, 6], np.int32)  # local groups 2..4 hold rows 13..59
    lhs = jnp.asarray(rng.standard_normal((ROWS, case.k)), jnp.bfloat16)
    stack = rng.standard_normal((LAYERS, LOCAL, case.k, case.n)) / np.sqrt(case.k)
    if case.fmt == "dense":
        stored = jnp.asarray(stack, jnp.bfloat16)
        w = np.asarray(stored, np.float64)
        columns = None
    else:
        q = pk.quantize_experts(jnp.asarray(stack, jnp.float32), case.fmt, gated=case.gated)
        w = np.asarray(pk.dequantize(q), np.float64)
        columns = None if not case.gated or q.tensor_scale is None else q.tensor_scale[1].reshape(LOCAL, case.n)
        stored = q.replace(tensor_scale=None) if columns is not None else q
    rhs = LayerOf(stored, jnp.int32(1)) if case.layer else jax.tree.map(lambda a: a[1], stored)
    bias = None if case.act is None else jnp.asarray(rng.standard_normal((LOCAL, case.n)), case.out_dtype)
    epilogue = None if case.act is None else (columns, bias, ACTS[case.act])
    return lhs, rhs, jnp.asarray(sizes), jnp.int32(2), epilogue, w[1]


def reference(case: Case, lhs, sizes, offset: int, epilogue, w) -> np.ndarray:
    """float64: out[r] = lhs[r] @ w[g(r) - offset] (+ bias, then act in f32) for rows r of local
    groups g, else 0."""
    x, bias = np.asarray(lhs, np.float64), None if epilogue is None else np.asarray(epilogue[1], np.float64)
    ends = np.cumsum(sizes)
    out = np.zeros((ROWS, case.n), np.float64)
    for j in range(LOCAL):
        lo, hi = ends[offset + j] - sizes[offset + j], ends[offset + j]
        out[lo:hi] = x[lo:hi] @ w[j] + (0 if bias is None else bias[j])
    if case.act is None:
        return out
    # act(0, 0) = 0: rows of no local group stay zero
    return np.asarray(ACTS[case.act](jnp.asarray(out[:, 0::2], jnp.float32), jnp.asarray(out[:, 1::2], jnp.float32)))


def run(case: Case, interpret: bool) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's output for `case` (offset and layer index traced) and its float64 reference."""
    lhs, rhs, sizes, offset, epilogue, w = make_operands(case)
    act = None if epilogue is None else epilogue[2]
    f = jax.jit(
        lambda lhs, rhs, sizes, offset, tables: gmm_mosaic_gpu(
            lhs,
            rhs,
            sizes,
            offset,
            case.out_dtype,
            interpret=interpret,
            tiles=tiles(ROWS, rhs, act is not None, tk=case.tk, steps=case.steps),
            epilogue=tables and (*tables, act),
        )
    )
    out = f(lhs, rhs, sizes, offset, epilogue and epilogue[:2])
    assert out.shape == (ROWS, case.n // (2 if case.act else 1)) and out.dtype == case.out_dtype
    return np.asarray(out, np.float64), reference(case, lhs, np.asarray(sizes), int(offset), epilogue, w)


def assert_matches(out: np.ndarray, expected: np.ndarray, out_dtype: str) -> None:
    """Within the output dtype's rounding of the largest value; rows of no local group exactly 0."""
    rel = 1e-5 if out_dtype == "float32" else 1e-2
    np.testing.assert_allclose(out, expected, rtol=rel, atol=rel * np.abs(expected).max())
    np.testing.assert_array_equal(out[expected.any(axis=1) == 0], 0.0)
    assert expected.any(axis=1).sum() == 46  # the local groups' rows, all checked above


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernel_matches_float64(name):
    """jax's Mosaic GPU interpreter (TMA copies, barriers, shared memory, wgmma) runs the kernel."""
    assert_matches(*run(CASES[name], interpret=True), CASES[name].out_dtype)


def abstract_h100(tree):
    return jax.tree.map(lambda a: on_h100(a.shape, a.dtype), tree)


def test_compiles_for_h100_as_one_mosaic_gpu_call_per_product():
    """Four products (bf16 gate_up of a layer with SwiGLU, NVFP4 down, MXFP4 gate_up at odd widths,
    and a bf16 down of K = 96: Qwen3-30B-A3B's expert slices over 8 devices, whole tiles of no
    128-byte swizzle) lower through Mosaic GPU and compile for a compile-only H100: one mosaic_gpu
    custom call each, each a bf16 wgmma."""

    def experts(fmt: str, k: int, n: int, gated: bool, layers: int | None = None):
        shape = (*((layers,) if layers else ()), 8, k, n)
        w = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        if fmt != "dense":
            # a gate|up stack's tensor scales, one per column, go to the epilogue (here: none)
            strip = lambda q: q.replace(tensor_scale=None) if gated else q
            w = jax.eval_shape(lambda a: strip(pk.quantize_experts(a, fmt, gated=gated)), w)
        return abstract_h100(w)

    def step(x, sizes, offset, layer, gate_up, down, odd, bias, odd_bias, sliced):
        def kernel(x, w, epilogue=None):
            chosen = tiles(x.shape[0], w, epilogue is not None)
            return gmm_mosaic_gpu(x, w, sizes, offset, jnp.bfloat16, tiles=chosen, epilogue=epilogue)

        h = kernel(x, LayerOf(gate_up, layer), epilogue=(None, bias, silu_glu))  # [T, 768]
        y = kernel(h, down)  # [T, 2048]
        z = kernel(y[:, :128], odd, epilogue=(None, odd_bias, ACTS["clamped_swiglu"]))  # [T, 20]
        return y, z, kernel(h[:, :96], sliced)  # [T, 2048]

    text = (
        jax.jit(step)
        .lower(
            on_h100((256, 2048), jnp.bfloat16),
            on_h100((8,), jnp.int32),
            on_h100((), jnp.int32),
            on_h100((), jnp.int32),
            experts("dense", 2048, 1536, True, layers=4),
            experts("nvfp4", 768, 2048, False),
            experts("mxfp4", 128, 40, True),
            on_h100((8, 1536), jnp.bfloat16),
            on_h100((8, 40), jnp.bfloat16),
            experts("dense", 96, 2048, False),
        )
        .compile()
        .as_text()
    )
    calls = [r.instr for r in hlo.pallas_calls(text)]
    assert [c.pallas for c in calls] == ["mosaic_gpu"] * 4
    assert all(
        "wgmma.mma_async.sync.aligned" in c.backend_config and ".f32.bf16.bf16" in c.backend_config for c in calls
    )
    assert all(hlo.writes_of(text, [(256, n)], ordered=True) for n in (768, 2048, 20))


def test_refuses_float32_with_its_reason():
    """wgmma multiplies float32 as TF32; the kernel says so rather than lose precision."""
    assert refusal(jnp.bfloat16) is None
    assert "TF32" in refusal(jnp.float32)
    lhs, rhs, sizes, offset, _, _ = make_operands(CASES["bf16"])
    with pytest.raises(ValueError, match="TF32"):
        gmm_mosaic_gpu(lhs.astype(jnp.float32), rhs, sizes, offset, jnp.float32, tiles=tiles(ROWS, rhs))


@pytest.mark.parametrize(
    "chosen,match",
    [
        (dict(tm=32), "tm=32"),
        (dict(tk=96), "tk=96"),
        (dict(tn=48), "tn=48"),
        (dict(tn=32), "128 bytes"),  # 32 bf16 output columns: a TMA row piece would start unaligned
        (dict(steps=1), "steps=1"),
    ],
)
def test_rejects_tiles_hopper_cannot_take(chosen, match):
    lhs, rhs, sizes, offset, _, _ = make_operands(CASES["bf16"])
    with pytest.raises(ValueError, match=match):
        gmm_mosaic_gpu(lhs, rhs, sizes, offset, jnp.bfloat16, tiles=tiles(ROWS, rhs, **chosen))
