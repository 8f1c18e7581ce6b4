"""Kernel-side decoding of 4-bit tiles with integer/bit arithmetic only.

The Mosaic TPU and Triton lowerings have no float4/float8 converts on every chip, so the
kernels (and the XLA loop, to share one code path) take codes and scales as uint8 bits and
build f32 bit patterns. tests/test_formats.py checks these against the ml_dtypes casts that
`formats.dequantize` uses, for every code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _f32(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits, jnp.float32)


def e2m1_to_f32(code: jax.Array) -> jax.Array:
    """e2m1 code (int32, 0..15): sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0.

    Integer ops and one select (this is the inner loop of every 4-bit dot on CPU): a normal
    magnitude c = code & 7 >= 2 has f32 bits ((c >> 1) + 126) << 23 | (c & 1) << 22, which is
    (c + 252) << 22; c == 1 is the subnormal 0.5, whose f32 bits are 252 << 22; c == 0 is 0.
    """
    c = code & 7
    bits = jnp.where(c >= 2, (c + 252) << 22, c * (252 << 22))
    return _f32(bits | ((code & 8) << 28))


def e4m3_to_f32(b: jax.Array) -> jax.Array:
    """float8_e4m3fn bits (int32): exponent bias 7, subnormals m * 2^-9; NaN never stored."""
    e, m = (b >> 3) & 15, b & 7
    mag = jnp.where(e == 0, m.astype(jnp.float32) * 2.0**-9, _f32(((e + 120) << 23) | (m << 20)))
    return jnp.where(b >= 128, -mag, mag)


def e8m0_to_f32(b: jax.Array) -> jax.Array:
    """float8_e8m0fnu bits (int32): 2^(b - 127); quantize never stores b == 0 (see formats)."""
    return _f32(b << 23)


def scale_to_f32(bits: jax.Array, fmt: str) -> jax.Array:
    return e4m3_to_f32(bits) if fmt == "nvfp4" else e8m0_to_f32(bits)


def half_values(codes: jax.Array, half: int, scale: jax.Array, byte: int = 0) -> jax.Array:
    """K-half `half`'s values (f32) of packed 4-bit codes (int32): byte `byte` of each holds two e2m1
    codes, K-half 0's in its low nibble and K-half 1's in its high one (`formats`' half-split
    packing), each times `scale` (f32, broadcast against codes: its block's scale). Every kernel's
    decode of a tile is this, over its own layout of codes and scales."""
    return e2m1_to_f32((codes >> (8 * byte + 4 * half)) & 15) * scale


def decode_tile(
    values: jax.Array, scales_lo: jax.Array, scales_hi: jax.Array, block: int, fmt: str
) -> tuple[jax.Array, jax.Array]:
    """values uint8 [kh, n] -> (lo, hi) f32 [kh, n], the two K-halves the bytes hold.

    scales_lo/hi: uint8 [kh/block, n], the scales of those halves. Multiply by the tensor
    scale (nvfp4) after the dot, where it costs [rows, n] instead of [kh, n] multiplies.
    """
    kh, n = values.shape
    blocks = values.astype(jnp.int32).reshape(kh // block, block, n)  # a scale row [n] each block
    return tuple(
        half_values(blocks, h, scale_to_f32(s.astype(jnp.int32), fmt)[:, None, :]).reshape(kh, n)
        for h, s in enumerate((scales_lo, scales_hi))
    )
