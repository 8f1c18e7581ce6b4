"""NVFP4 / MXFP4: exactness on representable values, error bounds, byte counts, decoders."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import decode

# The 16 e2m1 values by code, from ml_dtypes (a float4 occupies the low nibble of a byte).
E2M1_GRID = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def _blocks_on_grid(rng, lead: int, k: int, n: int, block: int) -> np.ndarray:
    """Grid values [lead, K, N] with a +-6 in every block along K (so amax = 6 * scale)."""
    v = rng.choice(E2M1_GRID, size=(lead, k // block, block, n))
    v[:, :, 0, :] = rng.choice([-6.0, 6.0], size=(lead, k // block, n))
    return v.reshape(lead, k, n)


def test_mxfp4_exact_on_representable_values():
    rng = np.random.default_rng(0)
    k, n = 128, 24
    scale = 2.0 ** rng.integers(-20, 20, size=(3, k // 32, 1, n))
    w = (_blocks_on_grid(rng, 3, k, n, 32).reshape(3, k // 32, 32, n) * scale).reshape(3, k, n)
    q = pk.quantize(jnp.asarray(w, jnp.float32), "mxfp4")
    np.testing.assert_array_equal(np.asarray(pk.dequantize(q)), w)
    np.testing.assert_array_equal(np.asarray(q.scales, np.float32)[:, :, None, :], scale)


def test_nvfp4_exact_on_representable_values():
    rng = np.random.default_rng(1)
    k, n, g = 64, 16, 2.0**-4  # g a power of two: amax / 2688 and s * g are exact in f32
    e4m3 = np.arange(0x08, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = rng.choice(e4m3, size=(2, k // 16, 1, n))
    s[:, 0, :, 0] = 448.0  # one block per matrix sets amax(tensor) = 6 * 448 * g
    w = (_blocks_on_grid(rng, 2, k, n, 16).reshape(2, k // 16, 16, n) * (s * g)).reshape(2, k, n)
    q = pk.quantize(jnp.asarray(w, jnp.float32), "nvfp4")
    np.testing.assert_array_equal(np.asarray(q.tensor_scale), np.full((2, 1, 1), g, np.float32))
    np.testing.assert_array_equal(np.asarray(pk.dequantize(q)), w)


@pytest.mark.parametrize("fmt,bound", [("nvfp4", 0.19), ("mxfp4", 0.5)])
def test_round_trip_error_bounds(fmt, bound):
    """Per element, the error is at most bound * amax(block); on Gaussians the RMS is small."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 256, 32)).astype(np.float32) * np.exp(rng.standard_normal((4, 1, 32)))
    q = pk.quantize(jnp.asarray(w), fmt)
    err = np.abs(np.asarray(pk.dequantize(q)) - w)
    block = pk.FORMATS[fmt].block
    amax = np.abs(w).reshape(4, 256 // block, block, 32).max(axis=2, keepdims=True)
    assert (err.reshape(4, 256 // block, block, 32) <= bound * amax).all()
    assert np.sqrt((err**2).mean() / (w**2).mean()) < 0.12


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_zero_blocks_and_zero_tensor_give_zeros_not_nan(fmt):
    w = np.zeros((2, 64, 8), np.float32)
    w[1, :32, :] = np.linspace(-3, 3, 32 * 8).reshape(32, 8)  # matrix 1: half its blocks zero
    out = np.asarray(pk.dequantize(pk.quantize(jnp.asarray(w), fmt)))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_array_equal(out[1, 32:], 0.0)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_layout_shapes_and_axis(fmt):
    w = jnp.ones((3, 128, 40), jnp.bfloat16)
    q = pk.quantize(w, fmt)
    block = pk.FORMATS[fmt].block
    assert q.shape == (3, 128, 40) and q.axis == -2
    assert q.values.shape == (3, 64, 40) and q.values.dtype == jnp.uint8
    assert q.scales.shape == (3, 128 // block, 40)
    assert pk.nbytes(q) == 3 * 64 * 40 + 3 * (128 // block) * 40
    assert pk.values_nbytes(q) == 3 * 64 * 40
    assert pk.nbytes(w) == 3 * 128 * 40 * 2
    # Quantizing along another axis is the same as quantizing the transpose.
    wt = jax.random.normal(jax.random.key(0), (3, 40, 128))
    np.testing.assert_array_equal(
        np.asarray(pk.dequantize(pk.quantize(wt, fmt, axis=-1))),
        np.swapaxes(np.asarray(pk.dequantize(pk.quantize(jnp.swapaxes(wt, 1, 2), fmt))), 1, 2),
    )


def test_quantize_is_jit_and_vmap_friendly():
    w = jax.random.normal(jax.random.key(1), (4, 64, 16))
    stacked = pk.quantize(w, "nvfp4")
    mapped = jax.vmap(lambda m: pk.quantize(m, "nvfp4"))(w)
    jitted = jax.jit(pk.quantize, static_argnames=("fmt", "axis"))(w, "nvfp4")
    for other in (mapped, jitted):
        jax.tree.map(np.testing.assert_array_equal, stacked, other)
    np.testing.assert_array_equal(jax.jit(pk.dequantize)(stacked), pk.dequantize(stacked))


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown 4-bit format"):
        pk.quantize(jnp.ones((64, 8)), "int4")
    with pytest.raises(ValueError, match="multiple of 64"):
        pk.quantize(jnp.ones((48, 8)), "mxfp4")


def test_glm_expert_bytes_match_the_article():
    """Three 2,048 x 6,144 matrices: 18.9 MB of values, about 21 MB with NVFP4 scales."""
    expert = jax.ShapeDtypeStruct((3, 6144, 2048), jnp.bfloat16)  # [3, K, N], K = hidden
    q = jax.eval_shape(lambda w: pk.quantize(w, "nvfp4"), expert)
    assert pk.values_nbytes(q) == 18_874_368  # 18.9 MB
    assert round(pk.nbytes(q) / 1e6, 1) == 21.2
    mx = jax.eval_shape(lambda w: pk.quantize(w, "mxfp4"), expert)
    assert pk.nbytes(mx) == 18_874_368 + 18_874_368 * 2 // 32


def test_nvfp4_row_dispatch_bytes():
    rows = jax.random.normal(jax.random.key(2), (5, 6144), jnp.bfloat16)
    q = pk.quantize_rows(rows, "nvfp4")
    assert pk.nbytes(q) == 5 * 3456  # 3,072 value bytes + 384 e4m3 scales per row
    assert q.tensor_scale.shape == (5, 1)  # one f32 per row: a row decodes on its own
    np.testing.assert_allclose(pk.dequantize(q), rows.astype(jnp.float32), atol=0.2 * 4.5)
    alone = pk.quantize_rows(rows[3:4], "nvfp4")
    np.testing.assert_array_equal(pk.dequantize(alone)[0], pk.dequantize(q)[3])


def test_bit_decoders_match_ml_dtypes_for_every_code():
    codes = jnp.arange(16, dtype=jnp.int32)
    np.testing.assert_array_equal(decode.e2m1_to_f32(codes), E2M1_GRID)
    bits = np.arange(256, dtype=np.uint8)
    finite = ~np.isnan(bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    np.testing.assert_array_equal(
        np.asarray(decode.e4m3_to_f32(jnp.asarray(bits, jnp.int32)))[finite],
        bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32)[finite],
    )
    normal = np.arange(1, 255)  # 0 is 2^-127 (an f32 subnormal), 255 is NaN
    np.testing.assert_array_equal(
        decode.e8m0_to_f32(jnp.asarray(normal, jnp.int32)),
        normal.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32),
    )


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_decode_tile_matches_dequantize(fmt):
    q = pk.quantize(jax.random.normal(jax.random.key(3), (128, 48)), fmt)
    bits = jax.lax.bitcast_convert_type(q.scales, jnp.uint8)
    half = bits.shape[0] // 2
    lo, hi = decode.decode_tile(q.values, bits[:half], bits[half:], q.spec.block, fmt)
    scale = 1.0 if q.tensor_scale is None else q.tensor_scale
    # (v * s) * g here, v * (s * g) in dequantize: equal up to one f32 rounding.
    np.testing.assert_allclose(jnp.concatenate([lo, hi]) * scale, pk.dequantize(q), rtol=2e-7)


@pytest.mark.parametrize("fmt", pk.FORMATS)
def test_gate_up_quantized_as_one_matrix_keeps_every_bit_of_gate_and_up_apart(fmt):
    """gate and up interleaved along N into one [E, K, 2F] stack: each half's values, block
    scales and (NVFP4) tensor scale are those of quantizing it alone, also per K-slice."""
    from moejax.model.layers import interleave_gate_up

    rng = np.random.default_rng(5)
    gate, up = (jnp.asarray(rng.normal(0, s, (3, 128, 32)), jnp.float32) for s in (0.02, 3.0))
    for k_slices in (1, 2):
        fused = pk.quantize_experts(interleave_gate_up(gate, up), fmt, k_slices, gated=True)
        for i, half in enumerate((gate, up)):
            alone = pk.quantize_experts(half, fmt, k_slices)
            np.testing.assert_array_equal(fused.values[..., i::2], alone.values)
            np.testing.assert_array_equal(
                np.asarray(fused.scales[..., i::2]).view(np.uint8), np.asarray(alone.scales).view(np.uint8)
            )
            if fmt == "nvfp4":
                np.testing.assert_array_equal(
                    fused.tensor_scale[..., i::2], jnp.broadcast_to(alone.tensor_scale, (3, 1, 32))
                )
