"""Grouped GEMM in plain XLA: untouched groups' weights are never read.

XLA:CPU loops over the touched groups only: for each local group with rows, the loop loads
(and, for 4-bit weights, decodes) that group's [K, N] once, then multiplies its rows in chunks
of `tm` rows starting at the group's first row; the last chunk is masked to the group. Decode
is bound by the touched experts' bytes, and large chunks keep prefill close to an einsum per
group (`jax.lax.ragged_dot` is ~60x slower than an einsum on XLA:CPU).

The loop's trip count is computed on the device, which an accelerator's runtime reads back to
the host on every iteration (XLA:GPU). There few rows (a decode step) each load their own
group (4-bit ones decoded) and multiply it, with no loop, and many rows go a tile of `tm` rows
at a time through a loop of as many tiles as the rows can fill (megablox's schedule): each tile
one group's, the tiles past the rows' own masked. The caller's `gemm_rows` chooses the way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import decode, formats, layered
from pallas_kernels.epilogue import finish, finish_product, gate_up_columns, glu
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


def _group_matmul(rhs, g: jax.Array, tm: int, precision):
    """Group g of rhs (an array or QuantizedArray stack, a `layered.LayerOf` or `layered.Groups`
    one) as apply(x [tm, K] f32) -> [tm, N] f32, its weights loaded once for all its chunks.

    Row at a time (tm 1) on a group held in its own f32 buffer, each product reads the buffer
    where it lies (`lax.switch` to the group's branch): the first row streams the weights from
    memory, the next find them in cache. Otherwise the group is loaded once, as the f32
    operands its products read (a copy of it, or its 4-bit bytes decoded), and every chunk
    multiplies those.
    """
    if isinstance(rhs, layered.Groups):
        if tm == 1 and all(a.dtype == jnp.float32 for a in jax.tree.leaves(rhs.groups[0])):
            branches = [lambda x, w=w: _product(_load(w), x, precision) for w in rhs.groups]
            return lambda x: lax.switch(g, branches, x)
        ops = lax.switch(g, [lambda w=w: _load(w) for w in rhs.groups])
    else:
        # Tying rhs to the loop-varying g keeps XLA from hoisting the convert / decode of the
        # whole [G, K, N] out of the group loop (XLA:CPU moves converts above the dynamic-slice),
        # which would read every group's weights on every call.
        ops = _load(layered.group(*lax.optimization_barrier((rhs, g))))
    return lambda x: _product(ops, x, precision)


def _load(w) -> tuple:
    """A group's [K, N] weights as the f32 operands of its product: (w,), or for 4-bit weights the
    two K-halves its bytes hold, decoded, and its tensor scale if it has one (so that the product is
    x[:, :K/2] @ lo + x[:, K/2:] @ hi with no interleave). Math is f32: XLA:CPU's bf16 dots are
    several times slower than its f32 ones, and the reference stays exact."""
    if not isinstance(w, formats.QuantizedArray):
        return (_to_f32(w),)  # [K, N]
    kh, block = w.values.shape[0], w.spec.block
    bits = lax.bitcast_convert_type(w.scales, jnp.uint8)  # [K/B, N]
    lo, hi = decode.decode_tile(w.values, bits[: kh // block], bits[kh // block :], block, w.fmt)
    return (lo, hi) if w.tensor_scale is None else (lo, hi, w.tensor_scale)  # scale [1, 1], or [1, N] column-wise


def _product(ops: tuple, x: jax.Array, precision) -> jax.Array:
    """x [rows, K] f32 @ a group's loaded operands (`_load`) -> [rows, N] f32."""
    if len(ops) == 1:
        return jnp.dot(x, ops[0], precision=precision)
    lo, hi, *scale = ops
    kh = lo.shape[0]
    y = jnp.dot(x[:, :kh], lo, precision=precision) + jnp.dot(x[:, kh:], hi, precision=precision)
    return y * scale[0] if scale else y


def _per_row(lhs, rhs, group_sizes, group_offset, batched: bool, precision) -> jax.Array:
    """Few rows: each row times its own group's weights, loaded (4-bit ones decoded) for it alone
    -> [M, N] f32; rows of other devices' groups, or past every group, 0. `batched`: every row's
    weights in one gather and one batched product (on XLA:CPU a group of the loop costs more
    beyond reading its weights than a second read of a group two rows share); else a slice and a
    product per row."""
    m, g_local = lhs.shape[0], rhs.shape[0]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    # every row against every group end: no loop (the default's binary search is one)
    local = jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right", method="compare_all") - group_offset
    mine = (local >= 0) & (local < g_local)  # rows of other devices' groups, or past every group: 0
    local = jnp.clip(local, 0, g_local - 1)
    x = _to_f32(lhs)[:, None]  # [M, 1, K]
    row = lambda g, x: _product(_load(layered.group(rhs, g)), x, precision)  # [1, N]
    y = jax.vmap(row)(local, x) if batched else jnp.stack([row(local[r], x[r]) for r in range(m)])
    return jnp.where(mine[:, None], y[:, 0], 0.0)


TILE_ROWS = 128  # rows per tile of the accelerators' loop over tiles


def fuses_glu(m: int, n: int, rhs) -> bool:
    """Whether `gmm_xla` applies a gate|up product's activation (`epilogue`), or sums the rows into
    their tokens (`combine`), itself: always (its loops as each chunk is written, its products of
    one row each after them)."""
    return True


fuses_combine = fuses_glu


def gmm_xla(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    out_dtype,
    tm: int | None = None,
    *,
    lhs_rows=None,
    combine=None,
    bias=None,
    epilogue=None,
    gemm_rows=None,
    precision=None,
):
    """lhs [M, K], rhs [G_local, K, N] (array or QuantizedArray, or a LayerOf either),
    group_sizes [G] -> [M, N], the way gemm_rows(M, 4-bit rhs) gives (a platform's choice,
    `moejax.base.platform.Platform.gemm_rows`): "groups", "gather", "rows" or "tiles" (None: "groups");
    its products at jax's matmul `precision` (None: the default).

    lhs_rows [M] (lhs then [T, K]): row r is lhs[lhs_rows[r]], gathered by each chunk as it
    goes, so the sorted [M, K] rows are never written.
    combine = (order [M], weights [T, k]): -> [T, N], each chunk's rows (+ their group's row of
    bias [G_local, N]) weighted and added into their tokens' rows as the loop goes, so the [M, N]
    product is never written: a token's picks are summed in group order.
    epilogue = (None, bias [G_local, N] or None, act): rhs a gate|up stack -> [M, N/2], each chunk's
    rows finished (+ their group's bias) and through act(gate, up) as the loop goes, as
    `registry.grouped_gemm` does to an unfused product: [M, N] is never written.
    Few rows, multiplied a row each without a loop, are finished after their product (`finish_product`).
    """
    m, n = (lhs if lhs_rows is None else lhs_rows).shape[0], rhs.shape[2]
    g_local = rhs.shape[0]
    act = None
    if epilogue is not None:
        _, bias, act = epilogue  # no column scales: the loop applies a stack's own as it decodes
    way = (
        "groups"
        if isinstance(rhs, layered.Groups) or gemm_rows is None
        else gemm_rows(m, isinstance(layered.stored(rhs), formats.QuantizedArray))
    )
    if way in ("gather", "rows"):
        lhs = lhs if lhs_rows is None else lhs[lhs_rows]
        y = _per_row(lhs, rhs, group_sizes, group_offset, way == "gather", precision)
        return finish_product(y, out_dtype, None, bias, group_sizes, group_offset, act, combine)
    tm = tm or (min(TILE_ROWS, m) if way == "tiles" else _pick_tm(m, group_sizes.shape[0]))
    lhs32 = _to_f32(lhs)  # [M or T, K], once rather than per chunk
    like = (lhs, rhs, group_sizes, group_offset, lhs_rows, combine, bias)  # what the output varies over
    if combine is None:
        out0 = varying_zeros((m, n if act is None else n // 2), jnp.float32, *like)

        def write(out, y, p0, in_group, g):  # y [tm, N] (activated: [tm, N/2]) into the rows of the group
            if act is not None:  # as the registry finishes an unfused product: bias, then act(gate, up)
                y = glu(
                    *gate_up_columns(finish(y, out_dtype, None, None if bias is None else bias[g][None])), act
                ).astype(jnp.float32)
            keep = lax.dynamic_slice_in_dim(out, p0, tm, 0)
            return lax.dynamic_update_slice_in_dim(out, jnp.where(in_group[:, None], y, keep), p0, 0)
    else:
        order, weights = combine
        t, k = weights.shape
        tokens = order // k  # [M] each sorted row's token
        scales = weights.reshape(-1)[order].astype(jnp.float32)  # [M] each sorted row's pick weight
        out0 = varying_zeros((t, n), jnp.float32, *like)

        def write(out, y, p0, in_group, g):  # y [tm, N] weighted into its rows' tokens
            if bias is not None:
                y = y + bias[g].astype(jnp.float32)
            s = jnp.where(in_group, lax.dynamic_slice_in_dim(scales, p0, tm), 0.0)
            return out.at[lax.dynamic_slice_in_dim(tokens, p0, tm)].add(y * s[:, None])

    def chunk(matmul, out, pos, end, g, live=True):  # rows pos .. pos + tm - 1 of group g, those below end
        p0 = jnp.minimum(pos, m - tm)  # the last chunk may hang over the end of lhs
        x = (
            lax.dynamic_slice_in_dim(lhs32, p0, tm, 0)
            if lhs_rows is None
            else lhs32[lax.dynamic_slice_in_dim(lhs_rows, p0, tm)]
        )  # [tm, K]
        y = matmul(x)  # [tm, N]
        rows = p0 + lax.iota(jnp.int32, tm)
        return write(out, y, p0, (rows >= pos) & (rows < end) & live, g)

    if way == "tiles":
        # The local groups' tiles come first; each group adds at most one tile to the rows' own.
        from pallas_kernels import tiling  # megablox's schedule: not loaded where no accelerator runs it

        m_pad = -(-m // tm) * tm
        offset, (offsets, group_ids, m_tile_ids), num_tiles = tiling.schedule(
            group_sizes, group_offset, g_local, m_pad, tm
        )

        def tile(t, out):  # tile t: rows of one group in one [tm]-row tile; past num_tiles, none
            g_global = group_ids[t]
            g = jnp.clip(g_global - offset[0], 0, g_local - 1)
            pos = m_tile_ids[t] * tm
            rows_end = jnp.minimum(offsets[g_global + 1], pos + tm)
            live = t < num_tiles
            return chunk(
                _group_matmul(rhs, g, tm, precision), out, jnp.maximum(pos, offsets[g_global]), rows_end, g, live
            )

        return lax.fori_loop(0, m_pad // tm + g_local - 1, tile, out0).astype(out_dtype)

    starts, sizes, active, num_active = local_groups(group_sizes, group_offset, g_local, m)

    def group_body(i, out):  # out: [M or T, N] f32
        g = active[i]
        start, end = starts[g], starts[g] + sizes[g]
        matmul = _group_matmul(rhs, g, tm, precision)  # loaded here once for all its chunks
        return lax.fori_loop(
            0, (sizes[g] + tm - 1) // tm, lambda j, out: chunk(matmul, out, start + j * tm, end, g), out
        )

    # f32 out in the loop: XLA:CPU handles a bf16 loop carry through f32 round trips.
    return lax.fori_loop(0, num_active, group_body, out0).astype(out_dtype)
