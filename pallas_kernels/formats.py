"""NVFP4 and MXFP4: 4-bit e2m1 values with block scales along the reduction axis.

Layout (the same for weights and rows): along the quantized axis of length K, byte j of
`values` (j < K/2) holds the e2m1 code of element j in its low nibble and of element
j + K/2 in its high nibble ("half-split" packing). A kernel tile of the reduction axis then
unpacks into two contiguous half-tiles without any interleaving, which the TPU and GPU
lowerings cannot do cheaply. `scales` has one entry per block of `block` consecutive
elements along the same axis; K must be a multiple of 2 * block so that no block straddles
the two halves.

- MXFP4 (OCP Microscaling v1.0): block 32, scale 2^(floor(log2(amax)) - 2) as e8m0.
- NVFP4: block 16, f32 tensor scale g = amax / (448 * 6) per matrix (per row for
  `quantize_rows`), block scale e4m3(amax(block) / 6 / g), elements e2m1(v / (s * g)).

The value grids come from the ml_dtypes casts (round to nearest even, e2m1 saturates at 6).
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    block: int
    scale_dtype: jnp.dtype
    has_tensor_scale: bool


FORMATS = {
    "nvfp4": FormatSpec(16, jnp.float8_e4m3fn, True),
    "mxfp4": FormatSpec(32, jnp.float8_e8m0fnu, False),
}
E2M1_MAX = 6.0
E4M3_MAX = 448.0


@flax.struct.dataclass
class QuantizedArray:
    """A 4-bit array; every leaf keeps the leading (e.g. expert) dims of the logical array.

    values:       uint8, logical shape with `axis` halved (two e2m1 codes per byte).
    scales:       e4m3 (nvfp4) or e8m0 (mxfp4), logical shape with `axis` divided by block.
    tensor_scale: f32 (nvfp4) with size-1 dims where the tensor scale is shared; None (mxfp4).
    fmt, axis:    static; axis is negative so that vmap / slicing leading dims keeps it valid.
    """

    values: jax.Array
    scales: jax.Array
    tensor_scale: jax.Array | None
    fmt: str = flax.struct.field(pytree_node=False)
    axis: int = flax.struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.values.shape)
        shape[self.axis] *= 2
        return tuple(shape)

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def spec(self) -> FormatSpec:
        return FORMATS[self.fmt]


def _check(shape: tuple[int, ...], fmt: str, axis: int) -> int:
    if fmt not in FORMATS:
        raise ValueError(f"unknown 4-bit format {fmt!r}; expected one of {sorted(FORMATS)}")
    if not -len(shape) <= axis < len(shape):
        raise ValueError(f"axis {axis} out of range for shape {shape}")
    axis = axis - len(shape) if axis >= 0 else axis
    block = FORMATS[fmt].block
    if shape[axis] % (2 * block):
        raise ValueError(f"{fmt}: quantized axis has length {shape[axis]}, must be a multiple of {2 * block}")
    return axis


@functools.partial(jax.jit, static_argnames=("fmt", "axis", "tensor_axes"))
def _quantize(w: jax.Array, fmt: str, axis: int, tensor_axes: tuple[int, ...]) -> QuantizedArray:
    axis = _check(w.shape, fmt, axis)
    spec = FORMATS[fmt]
    x = jnp.moveaxis(w.astype(jnp.float32), axis, -1)  # [..., K]
    lead, k = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(*lead, k // spec.block, spec.block)  # [..., K/B, B]
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)  # [..., K/B, 1]
    if fmt == "mxfp4":
        # Exponents stop at -126: 2^-127 is an f32 subnormal, which CPUs flush to 0 (a NaN in
        # e8m0). Only blocks with amax < 2^-124 notice; all-zero blocks stay 0 either way.
        exp = jnp.floor(jnp.log2(jnp.where(amax > 0, amax, 1.0))) - 2
        scale = jnp.exp2(jnp.clip(exp, -126, 127)).astype(spec.scale_dtype)
        step = scale.astype(jnp.float32)
        tensor_scale = None
    else:
        t_axes = tuple(a % w.ndim for a in tensor_axes)
        g = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=t_axes, keepdims=True) / (E4M3_MAX * E2M1_MAX)
        g = jnp.where(g > 0, g, 1.0)  # an all-zero tensor: any g works, avoid 0 / 0
        g_blocks = jnp.moveaxis(g, axis, -1)[..., None]  # [..., 1, 1] against [..., K/B, 1]
        scale = jnp.minimum(amax / E2M1_MAX / g_blocks, E4M3_MAX).astype(spec.scale_dtype)
        step = scale.astype(jnp.float32) * g_blocks
        tensor_scale = g
    # A block scale that underflowed to 0 means every element rounds to 0.
    scaled = jnp.where(step > 0, blocks / jnp.where(step > 0, step, 1.0), 0.0)
    codes = (
        jax.lax.bitcast_convert_type(jnp.clip(scaled, -E2M1_MAX, E2M1_MAX).astype(jnp.float4_e2m1fn), jnp.uint4)
        .astype(jnp.uint8)
        .reshape(*lead, k)
    )
    packed = codes[..., : k // 2] | (codes[..., k // 2 :] << 4)  # [..., K/2]
    return QuantizedArray(
        values=jnp.moveaxis(packed, -1, axis),
        scales=jnp.moveaxis(scale[..., 0], -1, axis),
        tensor_scale=tensor_scale,
        fmt=fmt,
        axis=axis,
    )


def quantize(w: jax.Array, fmt: str, axis: int = -2, tensor_axes: tuple[int, ...] | None = None) -> QuantizedArray:
    """Quantizes weights w (e.g. experts [G, K, N]) with blocks along `axis`.

    NVFP4's tensor scale is per matrix (by default the last two dims), so stacked experts
    [G, K, N] carry one f32 scale each, as separately stored experts would.
    """
    chex.assert_type(w, float)
    if tensor_axes is None:
        tensor_axes = tuple(range(-min(2, w.ndim), 0))
    return _quantize(w, fmt, axis, tensor_axes=tuple(tensor_axes))


def quantize_rows(x: jax.Array, fmt: str = "nvfp4") -> QuantizedArray:
    """Quantizes rows x [M, K] along K with one tensor scale per row, so rows travel alone."""
    chex.assert_rank(x, 2)
    chex.assert_type(x, float)
    return _quantize(x, fmt, -1, tensor_axes=(-1,))


def unpack_codes(values: jax.Array, axis: int) -> jax.Array:
    """uint8 [.., K/2, ..] -> e2m1 codes as uint8 [.., K, ..] in logical order."""
    return jnp.concatenate([values & 0xF, values >> 4], axis=axis)


def expand_blocks(s: jax.Array, block: int, axis: int) -> jax.Array:
    """Repeats each block scale `block` times along `axis`: [.., K/B, ..] -> [.., K, ..]."""
    return jnp.repeat(s, block, axis=axis)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize(q: QuantizedArray, dtype=jnp.float32) -> jax.Array:
    codes = unpack_codes(q.values, q.axis).astype(jnp.uint4)
    v = jax.lax.bitcast_convert_type(codes, jnp.float4_e2m1fn).astype(jnp.float32)
    step = expand_blocks(q.scales.astype(jnp.float32), q.spec.block, q.axis)
    if q.tensor_scale is not None:
        step = step * q.tensor_scale
    return (v * step).astype(dtype)


def values_nbytes(x) -> int:
    """Bytes of the 4-bit values alone (Row-Meets-Experts §1: "18.9 MB per expert")."""
    if isinstance(x, QuantizedArray):
        return int(np.prod(x.values.shape)) * x.values.dtype.itemsize
    return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def nbytes(x) -> int:
    """Bytes of values + block scales (Row-Meets-Experts §1: "21 MB per expert"); arrays: plain nbytes.

    NVFP4's f32 tensor scales (one per matrix or row message) are left out, as Row-Meets-Experts leaves them out.
    """
    if isinstance(x, QuantizedArray):
        return values_nbytes(x) + int(np.prod(x.scales.shape)) * x.scales.dtype.itemsize
    return values_nbytes(x)


def quantize_experts(w: jax.Array, fmt: str, k_slices: int = 1, gated: bool = False) -> QuantizedArray:
    """Quantizes stacked experts w: [..., E, K, N] along K as `k_slices` independent K-slices
    laid end to end (a placement that slices K over tp devices packs tp slices).

    A packed byte holds two values of its own slice, so a device holding K-slice j of every
    expert holds a complete 4-bit matrix. Blocks never straddle slices and NVFP4's tensor scale
    stays per expert, so the values and scales are those of quantizing each whole matrix.
    `gated`: N interleaves gate and up columns (`pallas_kernels.epilogue.gate_up_columns`); each half
    keeps its own NVFP4 tensor scale (column-wise, [..., E, 1, N]), so every bit is that of
    quantizing gate and up apart."""
    *lead, k, n = w.shape
    parts = 2 if gated else 1
    q = quantize(
        jnp.asarray(w, jnp.float32).reshape(*lead, k_slices, k // k_slices, n // parts, parts),
        fmt,
        axis=-3,
        tensor_axes=(-4, -3, -2),
    )
    ts = q.tensor_scale
    if ts is not None:
        ts = (
            jnp.broadcast_to(ts, (*ts.shape[:-2], n // parts, parts)).reshape(*lead, 1, n)
            if gated
            else ts.reshape(*lead, 1, 1)
        )
    return q.replace(
        values=q.values.reshape(*lead, -1, n), scales=q.scales.reshape(*lead, -1, n), axis=-2, tensor_scale=ts
    )
