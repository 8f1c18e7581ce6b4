"""Grouped GEMM as a Pallas kernel lowered through Triton (Hopper, Blackwell).

Same tile schedule as the TPU kernel (megablox's `make_group_metadata`), but Triton has no
scalar prefetch: the grid is the static bound (M tiles + G - 1) x (N tiles), each program
reads its group and row tile from the metadata, and programs past the traced number of
active tiles return at once, so untouched groups' weights are never loaded. Programs run in
parallel, so an out tile shared by two groups is written with a row mask by each, never
read-modify-written. 4-bit tiles are decoded in registers, as two K-halves.

With a gated activation (`epilogue`), a program reads its 2 * (tn / 2) weight columns as two
stride-2 loads, the gate and the up columns, into two accumulators, and its epilogue applies
the column scales, the bias and act(gate, up) and writes [tm, tn/2].
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from moejax.platform import matmul_precision
from pallas_kernels import decode, epilogue, formats, metadata, tiling


def fuses_glu(m: int, n: int, rhs) -> bool:
    """Whether the epilogue can halve a gate|up product of N columns (Triton's blocks: a power
    of two of at least 16 output columns)."""
    return n % 32 == 0


def _kernel(num_tiles, group_ids, m_tile_ids, offsets, offset, tscale, *refs, quantized, fmt,
            block, tm, tk, tn, k, cdtype, tables, act):
    """One (active m tile, n tile) program; loops over K. Refs are whole arrays in HBM:
    lhs [M_pad, K], rhs (weights [G_local, K, N], or bytes [G_local, K/2, N] and scale bits
    [G_local, K/B, N]), the epilogue's column scales and bias [G_local, 1, N] where `tables`
    says so, out [M_pad, N] ([M_pad, N/2] with act)."""
    *ins, out_ref = refs
    cols_ref = ins.pop(len(ins) - sum(tables)) if tables[0] else None
    bias_ref = ins.pop() if tables[1] else None
    t, n_i = pl.program_id(0), pl.program_id(1)  # read outside pl.when: interpret mode wants it

    @pl.when(t < num_tiles[0])
    def _():
        g = group_ids[t]
        local, m0, n0 = g - offset[0], m_tile_ids[t] * tm, n_i * tn
        # float32 products at full precision (Triton's "ieee", not its default TF32)
        dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=matmul_precision(cdtype))
        rows = pl.ds(m0, tm)
        # The weight columns each accumulator reads: the tile, or its gate and its up columns.
        col_sets = [pl.ds(n0, tn)] if act is None else [pl.ds(n0 + i, tn // 2, stride=2) for i in (0, 1)]

        def product(k_i, cols):  # [tm, len(cols)] f32: one K step of the rows times these columns
            if quantized:
                x_ref, v_ref, s_ref = ins
                kh, half = k_i * (tk // 2), k // 2
                sb = tk // 2 // block
                w_lo, w_hi = decode.decode_tile(
                    v_ref[local, pl.ds(kh, tk // 2), cols],
                    s_ref[local, pl.ds(kh // block, sb), cols],
                    s_ref[local, pl.ds((half + kh) // block, sb), cols], block, fmt)
                return (dot(x_ref[rows, pl.ds(kh, tk // 2)].astype(cdtype), w_lo.astype(cdtype))
                        + dot(x_ref[rows, pl.ds(half + kh, tk // 2)].astype(cdtype), w_hi.astype(cdtype)))
            x_ref, w_ref = ins
            return dot(x_ref[rows, pl.ds(k_i * tk, tk)].astype(cdtype),
                       w_ref[local, pl.ds(k_i * tk, tk), cols].astype(cdtype))

        def step(k_i, accs):  # accs: one [tm, tn / len(col_sets)] f32 per column set
            return tuple(acc + product(k_i, cols) for acc, cols in zip(accs, col_sets))

        width = tn // len(col_sets)
        accs = lax.fori_loop(0, k // tk, step, tuple(jnp.zeros((tm, width), jnp.float32) for _ in col_sets))
        ys = [epilogue.finish(acc, out_ref.dtype,
                              tscale[local] * (1.0 if cols_ref is None else cols_ref[local, :, cols]),
                              None if bias_ref is None else bias_ref[local, :, cols])
              for acc, cols in zip(accs, col_sets)]
        # Triton has no bf16 division (the sigmoid's): the activation's math is f32.
        y = ys[0] if act is None else epilogue.glu(*(y.astype(jnp.float32) for y in ys), act).astype(out_ref.dtype)
        row_ids = m0 + lax.broadcasted_iota(jnp.int32, (tm, width), 0)
        mine = (row_ids >= offsets[g]) & (row_ids < offsets[g + 1])
        pl_triton.store(out_ref.at[rows, pl.ds(n_i * width, width)], y, mask=mine)


def gmm_pallas_gpu(lhs, rhs, group_sizes, group_offset, out_dtype, *, interpret: bool = False,
                   tk: int | None = None, epilogue=None):
    """The Triton twin of `gmm_pallas_tpu`: the same arguments, epilogue and result."""
    m, k = lhs.shape
    g_local, _, n = rhs.shape
    quantized = isinstance(rhs, formats.QuantizedArray)
    # Triton blocks are powers of two, and tl.dot wants every dim >= 16.
    tm = min(64, max(16, 1 << (m - 1).bit_length()))
    tk = tk or tiling.k_tile(k, rhs, (128, 64) if quantized else (64, 32, 16))
    tables, has, act = tiling.epilogue_tables(epilogue, g_local)
    tn = tiling.pick_tile(n, (128, 64, 32) if act is not None else (128, 64, 32, 16))
    lhs_p, offset, (offsets, group_ids, m_tile_ids), num_tiles = tiling.group_tiles(
        lhs, group_sizes, group_offset, g_local, tm)
    if quantized:
        operands = (lhs_p, rhs.values, tiling.scale_bits(rhs))
        tscale, fmt, block = tiling.tensor_scales(rhs), rhs.fmt, rhs.spec.block
    else:
        operands = (lhs_p, rhs)
        tscale, fmt, block = jnp.ones((g_local,), jnp.float32), None, 1
    kernel = functools.partial(
        _kernel, quantized=quantized, fmt=fmt, block=block, tm=tm, tk=tk, tn=tn, k=k,
        cdtype=tiling.compute_dtype(lhs.dtype, rhs), tables=has, act=act)
    out_cols = n // 2 if act is not None else n
    out = pl.pallas_call(
        kernel,
        out_shape=metadata.varying_struct((lhs_p.shape[0], out_cols), out_dtype, lhs, rhs, group_sizes,
                                          group_offset),
        grid=(group_ids.shape[0], n // tn),
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        cost_estimate=tiling.cost_estimate(lhs, rhs, lhs_p.shape[0], out_dtype, glu=act is not None),
    )(num_tiles.reshape(1), group_ids, m_tile_ids, offsets, offset, tscale, *operands, *tables)
    return tiling.zero_foreign_rows(out, offsets, offset[0], g_local, m)
