"""Grouped GEMM in plain XLA: a loop over the touched groups only.

For each local group with rows, the loop loads (and, for 4-bit weights, decodes) that
group's [K, N] once, then multiplies its rows in chunks of `tm` rows starting at the group's
first row; the last chunk is masked to the group. Untouched groups' weights are never read,
so decode is bound by the touched experts' bytes, and large chunks keep prefill close to an
einsum per group (`jax.lax.ragged_dot` is ~60x slower than an einsum on XLA:CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from moejax.platform import GATHER_ROWS
from pallas_kernels import decode, formats, layered
from pallas_kernels.metadata import local_groups, varying_zeros


def _pick_tm(m: int, num_groups: int) -> int:
    """Rows per chunk from the mean rows per group (all groups, local or not), measured on
    XLA:CPU: with few rows per group, row-at-a-time matrix-vector products on the group's
    decoded weights (re-read from cache) beat its small GEMMs, which cost several matvecs
    each inside a loop; with many, a power of two near a quarter of the mean (at most 256)
    keeps the dots large with little masked waste in each group's last chunk.
    """
    quarter = max(1, m // max(num_groups, 1) // 4)
    return min(256, 1 << (quarter.bit_length() - 1))


def _to_f32(a: jax.Array) -> jax.Array:
    """bf16 -> f32 as a 16-bit shift: XLA:CPU's convert is ~3x slower, and in decode it, not
    the memory, would bound the weight read."""
    if a.dtype != jnp.bfloat16:
        return a.astype(jnp.float32)
    bits = lax.bitcast_convert_type(a, jnp.uint16).astype(jnp.uint32) << 16
    return lax.bitcast_convert_type(bits, jnp.float32)


def _group_matmul(rhs, g: jax.Array):
    """Loads group g of rhs (possibly a `layered.LayerOf`) once; returns apply(x [rows, K] f32) -> [rows, N] f32.

    A 4-bit rhs is decoded for this group only, as the two K-halves its bytes hold, so the
    product is x[:, :K/2] @ lo + x[:, K/2:] @ hi with no interleave. Math is f32: XLA:CPU's
    bf16 dots are several times slower than its f32 ones, and the reference stays exact.
    """
    w = layered.group(rhs, g)
    if not isinstance(w, formats.QuantizedArray):
        w = _to_f32(w)  # [K, N]
        return lambda x: jnp.dot(x, w)
    kh, block = w.values.shape[0], w.spec.block
    bits = lax.bitcast_convert_type(w.scales, jnp.uint8)  # [K/B, N]
    lo, hi = decode.decode_tile(w.values, bits[: kh // block], bits[kh // block :], block, w.fmt)
    scale = 1.0 if w.tensor_scale is None else w.tensor_scale  # [1, 1], or [1, N] column-wise
    return lambda x: (jnp.dot(x[:, :kh], lo) + jnp.dot(x[:, kh:], hi)) * scale


def _gathered(lhs, rhs, group_sizes, group_offset) -> jax.Array:
    """Few rows: each row's group's weights gathered in one op ([M, K, N]) and one batched
    product. On XLA:CPU a group of the loop costs more beyond reading its weights than a second
    read of a group two rows share."""
    m, g_local = lhs.shape[0], rhs.shape[0]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    local = jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right") - group_offset  # [M]
    mine = (local >= 0) & (local < g_local)  # rows of other devices' groups, or past every group: 0
    w = _to_f32(layered.take(rhs, jnp.clip(local, 0, g_local - 1)))  # [M, K, N]
    return jnp.where(mine[:, None], jnp.einsum("mk,mkn->mn", _to_f32(lhs), w), 0.0)


def gmm_xla(lhs, rhs, group_sizes, group_offset, out_dtype, tm: int | None = None):
    """lhs [M, K], rhs [G_local, K, N] (array or QuantizedArray, or a LayerOf either),
    group_sizes [G] -> [M, N]."""
    m, n = lhs.shape[0], rhs.shape[2]
    g_local = rhs.shape[0]
    if m <= GATHER_ROWS and not isinstance(layered.stored(rhs), formats.QuantizedArray):
        return _gathered(lhs, rhs, group_sizes, group_offset).astype(out_dtype)
    tm = tm or _pick_tm(m, group_sizes.shape[0])
    lhs32 = _to_f32(lhs)  # [M, K], once rather than per chunk
    starts, sizes, active, num_active = local_groups(group_sizes, group_offset, g_local, m)

    def group_body(i, out):  # out: [M, N] f32
        g = active[i]
        start, end = starts[g], starts[g] + sizes[g]
        # Group g's weights, loaded and decoded once here for all its chunks (the chunk loop
        # carries them without copies). Tying rhs to the loop-varying g keeps XLA from hoisting
        # the convert / decode of the whole [G, K, N] out of this loop (XLA:CPU moves converts
        # above the dynamic-slice), which would read every group's weights on every call.
        matmul = _group_matmul(*lax.optimization_barrier((rhs, g)))

        def chunk(j, out):
            pos = start + j * tm
            p0 = jnp.minimum(pos, m - tm)  # the last chunk may hang over the end of lhs
            y = matmul(lax.dynamic_slice_in_dim(lhs32, p0, tm, 0))  # [tm, N]
            rows = p0 + lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
            keep = lax.dynamic_slice_in_dim(out, p0, tm, 0)
            return lax.dynamic_update_slice_in_dim(
                out, jnp.where((rows >= pos) & (rows < end), y, keep), p0, 0)

        return lax.fori_loop(0, (sizes[g] + tm - 1) // tm, chunk, out)

    # f32 out [M, N] in the loop: XLA:CPU handles a bf16 loop carry through f32 round trips.
    out = lax.fori_loop(0, num_active, group_body, varying_zeros((m, n), jnp.float32, lhs, rhs, group_sizes))
    return out.astype(out_dtype)
