"""The Blackwell (sm_100) grouped GEMMs: 4-bit rows x 4-bit weights (`gmm_blackwell`, block-scaled
tcgen05 on fp4 operands) and bf16 rows x 4-bit weights (`gmm_blackwell_bf16`, the weights decoded
into tensor memory).

No Blackwell GPU runs here, and jax 0.10.2's Mosaic GPU interpreter has no tcgen05 / TMEM rules.
Each kernel is compiled for a compile-only B200: XLA:GPU's compile runs Mosaic GPU's own (its
MLIR passes, PTX for sm_100a, ptxas), so a kernel that Mosaic cannot lower or that ptxas refuses
fails here; what only a GPU shows (numerics, races, hangs, speed) is tests/test_gpu.py's, on an
sm_100 GPU. Here: the operands as the kernels read them, and the bf16 kernel's decode (the
function its decoding warpgroup runs) against `formats.dequantize`. The Mosaic GPU paged attention's
MLA decode is compiled for the B200 in the same process (`test_paged_attention_mgpu.py` checks it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_paged_attention_mgpu
from compile_only import in_own_process, lower, on
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from moejax.base import targets
from moejax.compiled import hlo
from moejax.model.layers import silu_glu
from pallas_kernels import epilogue, gmm_blackwell, gmm_blackwell_bf16, layered, tiles
from pallas_kernels.layered import LayerOf
from pallas_kernels.registry import gemm_tiles

# Two stacked layers of 8 experts; 16 tokens of 2 picks. The hidden and expert widths D = F: the
# fp4 kernel's tiles divide them (it takes no other), the bf16 kernel's do not (its last K step and
# last CTA's columns reach past the edge, as with gpt-oss's 2880).
LAYERS, EXPERTS, TOKENS, TOP_K = 2, 8, 16, 2
WIDTHS = {"blackwell": 256, "blackwell_bf16": 320}


def _stack(shape, fmt: str, kernel: str, gated: bool):
    """Abstract stacked 4-bit experts [LAYERS, *shape] as a run loads them for `kernel`."""
    w = jax.ShapeDtypeStruct((LAYERS, *shape), jnp.float32)
    return jax.eval_shape(lambda a: pk.run_weights(a, fmt, kernel=kernel, gated=gated), w)


def _fp4_ffn(x, gate_up, down, sizes, order, weights, layer):
    """The expert FFN of one layer as the model calls it (`sharding.experts.expert_ffn`), through
    grouped_gemm's blackwell backend: gate_up with SwiGLU, down with each token's picks combined."""
    gmm = functools.partial(pk.grouped_gemm, group_sizes=sizes, backend="blackwell", preferred_element_type=x.dtype)
    h = gmm(x, LayerOf(gate_up, layer), act=silu_glu, lhs_rows=order // TOP_K)
    return gmm(h, LayerOf(down, layer), combine=(order, weights))


def bf16_kernel(x, rhs, sizes, offset, out_dtype, epilogue=None, **chosen):
    """`gmm_blackwell_bf16` with the tiles the registry hands it, but the test's `chosen` ones."""
    kernel_tiles = dataclasses.replace(gemm_tiles("blackwell_bf16", x.shape[0], rhs, epilogue is not None), **chosen)
    return gmm_blackwell_bf16.gmm_blackwell_bf16(
        x, rhs, sizes, offset, out_dtype, tiles=kernel_tiles, epilogue=epilogue
    )


def _bf16_ffn(x, gate_up, down, sizes, order, weights, layer):
    """The same through `gmm_blackwell_bf16` with the arguments grouped_gemm hands a kernel that
    fuses the activation: the column scales taken out of the stack into the epilogue, with a bias."""
    columns = None if gate_up.tensor_scale is None else layered.layer_slice(gate_up.tensor_scale, layer)
    bias = jnp.ones((EXPERTS, gate_up.shape[-1]), x.dtype)
    fused = (None if columns is None else columns.reshape(EXPERTS, -1), bias, silu_glu)
    gate_up = LayerOf(gate_up.replace(tensor_scale=None), layer)
    h = bf16_kernel(x[order // TOP_K], gate_up, sizes, 0, x.dtype, epilogue=fused)
    y = bf16_kernel(h, LayerOf(down, layer), sizes, 0, x.dtype)
    return epilogue.combine(y, order, weights)


FFNS = {"blackwell": _fp4_ffn, "blackwell_bf16": _bf16_ffn}


FMTS = ("nvfp4", "mxfp4")


def b200_ffn(kernel: str, fmt: str) -> str:
    """`kernel`'s expert FFN compiled for a compile-only B200 -> the optimized HLO. NVFP4 as the
    model runs it, inside a placement's shard_map, varying-axes checks as the catalog asks (where
    jax 0.10.2 lowers Mosaic GPU kernels as for an sm_90 GPU: its abstract device has no compute
    capability); MXFP4 as a plain jit lowers it on a B200 (`targets.lowering`: the B200 the
    default device, lowered as for sm_100)."""
    weights_kernel = "blackwell" if kernel == "blackwell" else "triton"  # the bf16 kernel reads QuantizedArrays
    width = WIDTHS[kernel]  # D = F
    args = (
        jax.ShapeDtypeStruct((TOKENS, width), jnp.bfloat16),
        _stack((EXPERTS, width, 2 * width), fmt, weights_kernel, gated=True),
        _stack((EXPERTS, width, width), fmt, weights_kernel, gated=False),
        jax.ShapeDtypeStruct((EXPERTS,), jnp.int32),
        jax.ShapeDtypeStruct((TOKENS * TOP_K,), jnp.int32),
        jax.ShapeDtypeStruct((TOKENS, TOP_K), jnp.float32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    device = targets.devices("b200", 1)[0]
    if fmt == "nvfp4":  # the rows and picks split over the mesh, as a placement's exchange takes them
        mesh = jax.sharding.Mesh((device,), ("x",))
        specs = (P("x"), P(), P(), P(), P("x"), P("x"), P())
        check_vma = pk.catalog.gemm(kernel).varying_operands  # as the placement's `moe` asks
        f = jax.jit(jax.shard_map(FFNS[kernel], mesh=mesh, in_specs=specs, out_specs=P("x"), check_vma=check_vma))
        typed = lambda a, spec: jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=jax.sharding.NamedSharding(mesh, spec)),
            a,
        )
        lowered = f.lower(*map(typed, args, specs))
    else:
        lowered = lower(jax.jit(FFNS[kernel]), *jax.tree.map(lambda a: on("b200", a.shape, a.dtype), args))
    return lowered.compile().as_text()


@functools.cache
def b200_programs() -> dict[str, str]:
    """Every kernel's FFN in every format compiled for a B200 -> {"kernel/fmt": optimized HLO}, in a
    process of their own (`in_own_process`): this process compiles the Hopper kernels for an H100."""
    return in_own_process(__file__)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("kernel", list(FFNS))
def test_kernel_compiles_for_a_b200(kernel, fmt):
    """Both products of an expert FFN (gate_up with SwiGLU, down with the picks combined), each
    reading its layer where it lies in a stack of two, are a Mosaic GPU kernel in the program
    XLA:GPU compiles for a B200: one custom call each, lowered, assembled for sm_100a by ptxas
    (the bf16 kernel at widths its tiles do not divide)."""
    calls = hlo.pallas_calls(b200_programs()[f"{kernel}/{fmt}"])
    assert [r.instr.pallas for r in calls] == ["mosaic_gpu"] * 2


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_kernel_operands(fmt):
    """prepare_weights: the same codes K-major as float4, the scales in the PTX `.scale_vec` tiling
    of tcgen05 block scaling, each expert's NVFP4 tensor scale where the kernel applies it."""
    q = pk.quantize(jax.random.normal(jax.random.key(6), (2, 256, 128)), fmt)
    prepared = gmm_blackwell.prepare_weights(q)
    codes = jax.lax.bitcast_convert_type(pk.formats.unpack_codes(q.values, -2).astype(jnp.uint4), jnp.float4_e2m1fn)
    np.testing.assert_array_equal(prepared.values.astype(jnp.float32), jnp.swapaxes(codes.astype(jnp.float32), 1, 2))
    scales = np.arange(256 * 16).reshape(256, 16)  # [MN, K/B]
    np.testing.assert_array_equal(
        gmm_blackwell._mma_scale_tiling(jnp.asarray(scales)),
        scales.reshape(2, 4, 32, 4, 4).transpose(0, 3, 2, 1, 4).reshape(2, 4, 32, 16),
    )
    per_expert = np.ones(2) if q.tensor_scale is None else np.asarray(q.tensor_scale).reshape(2)
    np.testing.assert_array_equal(prepared.group_scale, per_expert)
    assert prepared.tensor_scale is None


def test_fp4_kernel_leaves_a_gate_up_stacks_column_scales_to_grouped_gemm():
    """NVFP4 gate and up scaled apart: the per-half scales stay column-wise [.., E, N] (where
    grouped_gemm finds and applies them), the kernel's per-expert scales are 1, and a stack of
    layers keeps its per-expert scales [L, E] apart from them (never read as columns)."""
    w = jax.random.normal(jax.random.key(7), (LAYERS, 2, 128, 128))  # [L, E, K, N]
    stack = pk.run_weights(w, "nvfp4", kernel="blackwell", gated=True)
    np.testing.assert_array_equal(stack.group_scale, np.ones((LAYERS, 2)))
    columns = pk.quantize_experts(w, "nvfp4", gated=True).tensor_scale  # [L, E, 1, N]
    np.testing.assert_array_equal(stack.tensor_scale, columns.reshape(LAYERS, 2, 128))
    with pytest.raises(ValueError, match="column-wise tensor scales"):
        rhs = LayerOf(stack, 0)
        rows = jnp.zeros((16, 128), jnp.bfloat16)
        kernel_tiles = gemm_tiles("blackwell", 16, rhs)
        gmm_blackwell.gmm_blackwell(rows, rhs, jnp.array([16, 0], jnp.int32), 0, jnp.bfloat16, tiles=kernel_tiles)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_bf16_kernel_decodes_its_tiles_as_the_format(fmt):
    """The decoding warpgroup's function on the tiles it reads (each scale block of a K step's byte
    rows, a weight column a row, with the block's scale bits in both K-halves) gives the values
    formats.dequantize gives K-half 0's and K-half 1's rows (before the tensor scale), exactly in bf16."""
    k, n = 256, 128
    q = pk.quantize(3 * jax.random.normal(jax.random.key(3), (k, n)), fmt)
    expected = np.asarray(pk.dequantize(q.replace(tensor_scale=None)))  # [K, N]
    bits, block, tkb = (
        jax.lax.bitcast_convert_type(q.scales, jnp.uint8),
        q.spec.block,
        tiles.lookup("blackwell_bf16")["tkb"],
    )
    decode = jax.jit(functools.partial(gmm_blackwell_bf16.dequantize_block, fmt=fmt))
    for k0 in range(0, k // 2, tkb):  # the K steps
        for b in range(tkb // block):
            rows = slice(k0 + b * block, k0 + (b + 1) * block)
            lo, hi = decode(q.values[rows].T, bits[k0 // block + b], bits[(k // 2 + k0) // block + b])
            assert lo.dtype == hi.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(lo, np.float32), expected[rows].T)
            np.testing.assert_array_equal(np.asarray(hi, np.float32), expected[k // 2 :][rows].T)


def _bf16_call(m=32, k=256, n=256, dtype=jnp.bfloat16, fmt="nvfp4", act=None, **chosen):
    rhs = pk.quantize_experts(jnp.ones((2, k, n)), fmt) if fmt else jnp.ones((2, k, n), jnp.bfloat16)
    fused = None if act is None else (None, None, act)
    sizes = jnp.array([m // 2, m // 2], jnp.int32)
    x = jnp.ones((m, k), dtype)
    return lambda: bf16_kernel(x, rhs, sizes, 0, dtype, epilogue=fused, **chosen)


BAD_BF16_CALLS = {
    "float32 rows": (_bf16_call(dtype=jnp.float32), "multiplies bf16 rows"),
    "bf16 experts": (_bf16_call(fmt=None), "multiplies 4-bit experts"),
    "N of 200": (_bf16_call(n=200), "a multiple of 16; got K=256, N=200"),
    "K of 64": (_bf16_call(k=64), "K of at least 128"),
    "gated N of 192": (_bf16_call(n=192, act=silu_glu), "N of at least 256"),
    "row tile of 24": (_bf16_call(tm=24), "16 to 128 rows, a multiple of 16"),
}


@pytest.mark.parametrize("case", list(BAD_BF16_CALLS))
def test_bf16_kernel_refuses_what_it_cannot_multiply(case):
    call, message = BAD_BF16_CALLS[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_mla_attention_compiles_for_a_b200():
    """The Mosaic GPU paged attention's MLA decode (`latent_attention`, its CUDA-core code written for
    Hopper) assembles for sm_100a too: the kernel and the selection laid out as its blocks, one split."""
    launches = test_paged_attention_mgpu.latent_launches(b200_programs()["latent_attention"])
    assert launches == {"kernels": ["mosaic_gpu_v2"], "fusions": ["f32[4,4,64]{2,1,0}"]}


if __name__ == "__main__":  # b200_programs' process
    programs = {f"{k}/{f}": b200_ffn(k, f) for k in FFNS for f in FMTS}
    programs["latent_attention"] = test_paged_attention_mgpu.latent_program("b200", 1)
    Path(sys.argv[1]).write_text(json.dumps(programs))
