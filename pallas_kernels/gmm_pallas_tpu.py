"""Grouped GEMM as a Mosaic TPU kernel: megablox's schedule, 4-bit weights decoded in VMEM.

The grid is (N tiles, active M tiles, K tiles); the number of active M tiles is a traced
scalar from megablox's `make_group_metadata`, so tiles of groups with no rows (and of groups
outside [group_offset, group_offset + G_local)) are never scheduled and their weights never
leave HBM. group ids and tile ids are scalar-prefetched into SMEM and steer the BlockSpec
index maps. A layer of a run's stack (`layered.LayerOf`) is read where it lies: the stack
[L, G, K, N] viewed as [L * G, K, N] (`layered.flat`, a bitcast), the layer's first group
(prefetched) added to each group's index. TPUs have no fp4 matrix unit: a 4-bit tile [tk/2, tn]
of bytes is decoded to its two K-halves and multiplied in the rows' dtype (bf16 math, f32
accumulator in VMEM).

With a gated activation (`epilogue`), the last K step applies the column scales, the bias and
act(gate, up) to the [tm, tn] tile and writes [tm, tn/2]: Mosaic has no lane-strided load, so
the tile goes through a [tn, 128] VMEM scratch transposed, where gate and up columns are
alternate sublanes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import decode, epilogue, formats, layered, metadata, tiling

SCALE_SUBLANES = 32  # rows of a Mosaic tile of 8-bit data (the scale bits)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A call's blocks (`tiles.lookup("pallas_tpu", ..)`): tm rows (128 with act: the transposed
    tile's scratch [tn, tm] is loaded with a stride), tk of K and tn columns dividing K and N (a 4-bit
    tk / 2 whole scale blocks; tk = K: one step, its scale rows one block), tn = 256 with act."""

    tm: int
    tk: int
    tn: int


def fuses_glu(m: int, n: int, rhs) -> bool:
    """Whether the epilogue can halve a gate|up product of N columns: each tn = 256 tile
    writes 128 lanes, the narrowest out block Mosaic takes."""
    return n % 256 == 0


def shape_refusal(k: int, n: int, gated: bool, tiles: Tiles) -> str | None:
    """Why 4-bit experts [K, N] (per device) cannot be tiled, or None: a tile's two K-halves are
    blocks of the rows' columns, which Mosaic takes in whole 128-lane blocks (or the whole row),
    whatever `tiles`' K tile."""
    return f"4-bit experts need a K per device of a multiple of 256, these have {k}" if k % 256 else None


def _kernel(
    group_ids,
    m_tile_ids,
    offsets,
    offset,
    first,
    tscale,
    *refs,
    quantized,
    fmt,
    block,
    tm,
    tiles_k,
    cdtype,
    precision,
    tables,
    act,
):
    """One (n, active m tile, k) step. Refs: lhs (one, or its lo/hi K-halves for 4-bit),
    rhs (weights, or bytes + lo/hi scale bits), the epilogue's column scales and bias [1, tn]
    where `tables` says so, out [tm, tn] ([tm, tn/2] with act), acc [tm, tn] f32 scratch, and
    with act the [tn, tm] f32 scratch of the transposed tile."""
    if act is not None:
        *refs, pairs_ref = refs
    *ins, out_ref, acc_ref = refs
    cols_ref = ins.pop(len(ins) - sum(tables)) if tables[0] else None
    bias_ref = ins.pop() if tables[1] else None
    grid_id, k_i = pl.program_id(1), pl.program_id(2)

    @pl.when(k_i == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    # a float32 run's products at full precision (Mosaic's fp32 contraction, not one bf16 pass)
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)
    if quantized:
        x_lo, x_hi, values, *scales = ins
        if len(scales) == 1:  # one block of both halves' scale rows: split as int32 (8-row tiles)
            both = scales[0][...].astype(jnp.int32)
            s_lo, s_hi = both[: both.shape[0] // 2], both[both.shape[0] // 2 :]
        else:
            s_lo, s_hi = (s[...] for s in scales)
        w_lo, w_hi = decode.decode_tile(values[...], s_lo, s_hi, block, fmt)
        acc_ref[...] += dot(x_lo[...].astype(cdtype), w_lo.astype(cdtype)) + dot(
            x_hi[...].astype(cdtype), w_hi.astype(cdtype)
        )
    else:
        x, w = ins
        acc_ref[...] += dot(x[...].astype(cdtype), w[...].astype(cdtype))

    @pl.when(k_i == tiles_k - 1)
    def _():
        g = group_ids[grid_id]
        rows = m_tile_ids[grid_id] * tm + lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)
        mine = (rows >= offsets[g]) & (rows < offsets[g + 1])
        scale = tscale[g - offset[0]] * (1.0 if cols_ref is None else cols_ref[...])
        y = epilogue.finish(acc_ref[...], out_ref.dtype, scale, None if bias_ref is None else bias_ref[...])
        if act is not None:
            y = epilogue.glu(*_lane_pairs(y, pairs_ref), act)
        # An out tile shared by several groups is visited by each in turn; keep the others' rows.
        out_ref[...] = jnp.where(mine, y, out_ref[...])


def _lane_pairs(y, pairs_ref):
    """y [tm, tn] -> even and odd columns [tm, tn/2] each, through pairs_ref [tn, tm] f32:
    columns become sublanes, which Mosaic loads with a stride."""
    half = y.shape[1] // 2
    pairs_ref[...] = y.astype(jnp.float32).T
    return tuple(pairs_ref[pl.ds(i, half, stride=2), :].T.astype(y.dtype) for i in (0, 1))


def gmm_pallas_tpu(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    out_dtype,
    *,
    tiles: Tiles,
    interpret: bool = False,
    epilogue=None,
    precision=None,
):
    """lhs [M, K], rhs [G_local, K, N] (array or QuantizedArray, or a LayerOf either), group_sizes [G]
    -> [M, N].

    tiles: the blocks (`Tiles`). epilogue:
    (column scales [G_local, N] or None, bias [G_local, N] or None, act): a gate|up rhs
    (`fuses_glu`), out [M, N/2] = act(gate, up) of the scaled, biased product. precision: jax's
    matmul precision of the products (the run's: "highest" for float32; None: the platform's default).
    """
    m, k = lhs.shape
    g_local, _, n = rhs.shape
    # The layer's weights as abstract arrays: what the call reads, for its cost.
    layer = jax.eval_shape(layered.layer_slice, rhs.stack, 0) if isinstance(rhs, layered.LayerOf) else rhs
    rhs, first = layered.flat(rhs)  # the groups the maps index: the layer's from first[0] on
    quantized = isinstance(rhs, formats.QuantizedArray)
    tables, has, act = tiling.epilogue_tables(epilogue, g_local)
    tm, tk, tn = tiles.tm, tiles.tk, tiles.tn
    # tk / 2 / block scale rows should fill the 32-sublane tile of 8-bit data. Where they do not, K is
    # one step and its scale rows one block (the whole axis, which Mosaic takes at any size), split
    # into the halves' rows in the kernel.
    whole_scales = quantized and tk == k and (tk // 2 // rhs.spec.block) % SCALE_SUBLANES != 0
    tn_out = tn // 2 if act is not None else tn
    lhs_p, offset, (offsets, group_ids, m_tile_ids), num_tiles = tiling.group_tiles(
        lhs, group_sizes, group_offset, g_local, tm
    )
    tiles_k = k // tk

    def lhs_map(half):
        return lambda n_i, t, k_i, gids, mids, *_: (mids[t], k_i + half * tiles_k)

    def rhs_map(half):
        return lambda n_i, t, k_i, gids, mids, offs, off, at, ts: (gids[t] - off[0] + at[0], k_i + half * tiles_k, n_i)

    if quantized:
        half_rows, block = tk // 2, rhs.spec.block
        scale_halves = 1 if whole_scales else 2
        operands = (lhs_p, lhs_p, rhs.values, *(tiling.scale_bits(rhs),) * scale_halves)
        in_specs = [
            pl.BlockSpec((tm, half_rows), lhs_map(0)),
            pl.BlockSpec((tm, half_rows), lhs_map(1)),
            pl.BlockSpec((None, half_rows, tn), rhs_map(0)),
            *(
                pl.BlockSpec((None, 2 * half_rows // block // scale_halves, tn), rhs_map(half))
                for half in range(scale_halves)
            ),
        ]
        tscale, fmt = lax.dynamic_slice_in_dim(tiling.tensor_scales(rhs), first[0], g_local), rhs.fmt  # the layer's
    else:
        block, fmt = 1, None
        operands = (lhs_p, rhs)
        in_specs = [pl.BlockSpec((tm, tk), lhs_map(0)), pl.BlockSpec((None, tk, tn), rhs_map(0))]
        tscale = jnp.ones((g_local,), jnp.float32)
    operands += tuple(tables)
    in_specs += [
        pl.BlockSpec((None, 1, tn), lambda n_i, t, k_i, gids, mids, offs, off, at, ts: (gids[t] - off[0], 0, n_i))
        for _ in tables
    ]

    kernel = functools.partial(
        _kernel,
        quantized=quantized,
        fmt=fmt,
        block=block,
        tm=tm,
        tiles_k=tiles_k,
        cdtype=tiling.compute_dtype(lhs.dtype, rhs),
        precision=precision,
        tables=has,
        act=act,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=metadata.varying_struct(
            (lhs_p.shape[0], n * tn_out // tn), out_dtype, lhs, rhs, group_sizes, group_offset
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            in_specs=in_specs,
            out_specs=pl.BlockSpec((tm, tn_out), lambda n_i, t, k_i, gids, mids, *_: (mids[t], n_i)),
            grid=(n // tn, num_tiles, tiles_k),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)]
            + ([pltpu.VMEM((tn, tm), jnp.float32)] if act is not None else []),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        cost_estimate=tiling.cost_estimate(lhs, layer, lhs_p.shape[0], out_dtype, glu=act is not None),
    )(group_ids, m_tile_ids, offsets, offset, first, tscale, *operands)
    return tiling.zero_foreign_rows(out, offsets, offset[0], g_local, m)
