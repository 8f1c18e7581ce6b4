"""4-bit expert values on disk: one packing whatever the placement.

In memory a byte pairs the e2m1 codes of elements j and j + K/2 of its own K-slice
(`pallas_kernels.formats`), and a down projection under tensor slicing is packed slice by
slice (`Placement.place`), so the bytes depend on tp. On disk byte b holds elements 2b and
2b + 1 instead: any K-slice of whole block pairs is then a contiguous run of bytes, so every
device reads just its own bytes and repacks them locally for its tp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _codes(values: jax.Array, slices: int) -> jax.Array:
    """Slice-wise half-split packed [..., K/2, N] -> codes [..., K, N]."""
    *lead, h, n = values.shape
    v = values.reshape(*lead, slices, h // slices, n)
    return jnp.concatenate([v & 0xF, v >> 4], axis=-2).reshape(*lead, 2 * h, n)


def _half_split(codes: jax.Array, slices: int) -> jax.Array:
    *lead, k, n = codes.shape
    c = codes.reshape(*lead, slices, k // slices, n)
    half = k // slices // 2
    return (c[..., :half, :] | (c[..., half:, :] << 4)).reshape(*lead, k // 2, n)


@functools.partial(jax.jit, static_argnames="slices")
def to_disk(values: jax.Array, slices: int) -> jax.Array:
    codes = _codes(values, slices)
    *lead, k, n = codes.shape
    pairs = codes.reshape(*lead, k // 2, 2, n)
    return pairs[..., 0, :] | (pairs[..., 1, :] << 4)


@functools.partial(jax.jit, static_argnames=("slices", "sharding"))
def from_disk(values: jax.Array, slices: int, sharding=None) -> jax.Array:
    *lead, h, n = values.shape
    codes = jnp.stack([values & 0xF, values >> 4], axis=-2).reshape(*lead, 2 * h, n)
    out = _half_split(codes, slices)
    return out if sharding is None else jax.lax.with_sharding_constraint(out, sharding)
