"""Grouped GEMM as a Pallas kernel lowered through Triton (Hopper, Blackwell).

Same tile schedule as the TPU kernel (megablox's `make_group_metadata`), but Triton has no
scalar prefetch: the grid is the static bound (M tiles + G - 1) x (N tiles), each program
reads its group and row tile from the metadata, and programs past the traced number of
active tiles return at once, so untouched groups' weights are never loaded. Programs run in
parallel, so an out tile shared by two groups is written with a row mask by each, never
read-modify-written. 4-bit tiles are decoded in registers, as two K-halves.

Triton's blocks are powers of two (and a dot's dims at least 16); K and N are any widths: a
tile past the edge of K or N is masked, its loads read zeros there (nothing beyond the arrays
is read) and its stores write nothing. The masks are built only where a width is not a
multiple of its tile, so a power-of-two model runs the unmasked kernel.

The weights' columns are read as pairs [.., N/2, 2] (a reshape, no copy): with a gated
activation (`epilogue`), a program reads its tn / 2 (gate, up) column pairs as two loads, the
gate and the up columns, into two accumulators, and its epilogue applies the column scales,
the bias and act(gate, up) and writes [tm, tn/2]; without, the columns are [.., N, 1].

One layer of a run's stack (`layered.LayerOf`) is read where it lies: the kernel takes the stack
with its groups as one axis [L * G, ..] (`layered.flat`, a bitcast) and the layer's first group
there, so a scanned decode step copies no layer's experts out of the stack.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import decode, epilogue, formats, layered, metadata, tiling
from pallas_kernels.triton_blocks import column_pairs as _column_pairs
from pallas_kernels.triton_blocks import iota as _iota
from pallas_kernels.triton_blocks import load as _load


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A call's blocks (powers of two, every dot's dims at least 16; a 4-bit tk / 2 whole scale blocks;
    with act, tn counts gate and up columns) and launch settings (`tiles.lookup("triton", ..)`)."""

    tm: int  # rows of a program
    tk: int  # K per step of the loop over K
    tn: int  # weight columns of a program
    num_warps: int
    num_stages: int


def fuses_glu(m: int, n: int, rhs) -> bool:
    """Whether the epilogue can halve a gate|up product of N columns: any whole (gate, up) pairs."""
    return n % 2 == 0


def _kernel(
    sched,
    tscale,
    *refs,
    quantized,
    fmt,
    block,
    tm,
    tk,
    tn,
    k,
    n,
    pairs,
    cdtype,
    precision,
    tables,
    act,
):
    """One (active m tile, n tile) program; loops over K. Refs are whole arrays in HBM:
    lhs [M_pad, K], rhs (weights [G', K, N/p, p], or bytes [G', K/2, N/p, p] and scale bits
    [G', K/B, N/p, p]; p = `pairs`: 2 with act, the gate and up columns) and tscale [G'], whose
    local groups are sched.first[0] + [0, G_local) (G': a stack's every layer's groups), the
    epilogue's column scales and bias [G_local, 1, N/p, p] where `tables` says so, out
    [M_pad, N/p]."""
    *ins, out_ref = refs
    cols_ref = ins.pop(len(ins) - sum(tables)) if tables[0] else None
    bias_ref = ins.pop() if tables[1] else None
    t, n_i = pl.program_id(0), pl.program_id(1)  # read outside pl.when: interpret mode wants it

    @pl.when(sched.active(t))
    def _():
        g, local, m_tile, at = sched.tile(t)  # at: the group's weights
        m0 = m_tile * tm
        # a float32 run's products at full precision (Triton's "ieee", not its default TF32)
        dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)
        rows = pl.ds(m0, tm)
        width, out_cols = tn // pairs, n // pairs  # this program's output columns (column pairs), of out_cols
        cols = pl.ds(n_i * width, width)
        in_n = None if out_cols % width == 0 else _iota(width, 1, n_i * width) < out_cols  # [1, width]
        # A load's K span: the K-halves' of 4-bit bytes, else K's.
        kk, kt = (k // 2, tk // 2) if quantized else (k, tk)

        def in_k(k0, size, per, axis):  # [size, 1] or [1, size]: which of `size` units of `per` K rows from k0 lie in K
            return None if kk % kt == 0 else _iota(size, axis, k0 // per) < kk // per

        def product(k_i, i):  # [tm, width] f32: one K step of the rows times column set i
            k0 = k_i * kt
            if quantized:
                x_ref, v_ref, s_ref = ins
                sb, s_in = kt // block, in_k(k0, kt // block, block, 0)
                w_lo, w_hi = decode.decode_tile(
                    _load(v_ref.at[at, pl.ds(k0, kt), cols, i], in_k(k0, kt, 1, 0), in_n),
                    _load(s_ref.at[at, pl.ds(k0 // block, sb), cols, i], s_in, in_n),
                    _load(s_ref.at[at, pl.ds((kk + k0) // block, sb), cols, i], s_in, in_n),
                    block,
                    fmt,
                )
                return dot(
                    _load(x_ref.at[rows, pl.ds(k0, kt)], in_k(k0, kt, 1, 1)).astype(cdtype), w_lo.astype(cdtype)
                ) + dot(
                    _load(x_ref.at[rows, pl.ds(kk + k0, kt)], in_k(k0, kt, 1, 1)).astype(cdtype), w_hi.astype(cdtype)
                )
            x_ref, w_ref = ins
            return dot(
                _load(x_ref.at[rows, pl.ds(k0, kt)], in_k(k0, kt, 1, 1)).astype(cdtype),
                _load(w_ref.at[at, pl.ds(k0, kt), cols, i], in_k(k0, kt, 1, 0), in_n).astype(cdtype),
            )

        # The column sets (all columns, or the gate and the up ones) as array indices: interpret
        # mode's masked loads take no Python int.
        sets = [jnp.int32(i) for i in range(pairs)]

        def step(k_i, accs):  # accs: one [tm, width] f32 per column set
            return tuple(acc + product(k_i, i) for i, acc in zip(sets, accs))

        accs = lax.fori_loop(0, pl.cdiv(kk, kt), step, tuple(jnp.zeros((tm, width), jnp.float32) for _ in range(pairs)))
        ys = [
            epilogue.finish(
                acc,
                out_ref.dtype,
                tscale[at] * (1.0 if cols_ref is None else _load(cols_ref.at[local, :, cols, i], in_n)),
                None if bias_ref is None else _load(bias_ref.at[local, :, cols, i], in_n),
            )
            for i, acc in zip(sets, accs)
        ]
        # Triton has no bf16 division (the sigmoid's): the activation's math is f32.
        y = ys[0] if act is None else epilogue.glu(*(y.astype(jnp.float32) for y in ys), act).astype(out_ref.dtype)
        row_ids = _iota(tm, 0, m0)
        mine = (row_ids >= sched.offsets[g]) & (row_ids < sched.offsets[g + 1])
        pl_triton.store(out_ref.at[rows, cols], y, mask=mine if in_n is None else mine & in_n)


def gmm_pallas_gpu(
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
    """The Triton twin of `gmm_pallas_tpu`: the same arguments, epilogue and result; rhs may also
    be one layer of a stack (`layered.LayerOf`). tiles: the blocks and launch settings (`Tiles`)."""
    m, k = lhs.shape
    g_local, _, n = rhs.shape
    # The layer's weights as abstract arrays: what the call reads, for its cost.
    layer = jax.eval_shape(layered.layer_slice, rhs.stack, 0) if isinstance(rhs, layered.LayerOf) else rhs
    rhs, first = layered.flat(rhs)
    quantized = isinstance(rhs, formats.QuantizedArray)
    # Triton blocks are powers of two, and tl.dot wants every dim >= 16; the edge tiles are masked.
    tm, tk, tn = tiles.tm, tiles.tk, tiles.tn
    tables, has, act = tiling.epilogue_tables(epilogue, g_local)
    pairs = 1 if act is None else 2
    lhs_p = tiling.pad_rows(lhs, tm)
    sched = tiling.gpu_schedule(group_sizes, group_offset, g_local, lhs_p.shape[0], tm, first)
    if quantized:
        operands = (lhs_p, _column_pairs(rhs.values, pairs), _column_pairs(tiling.scale_bits(rhs), pairs))
        tscale, fmt, block = tiling.tensor_scales(rhs), rhs.fmt, rhs.spec.block
    else:
        operands = (lhs_p, _column_pairs(rhs, pairs))
        tscale, fmt, block = jnp.ones(rhs.shape[:1], jnp.float32), None, 1
    kernel = functools.partial(
        _kernel,
        quantized=quantized,
        fmt=fmt,
        block=block,
        tm=tm,
        tk=tk,
        tn=tn,
        k=k,
        n=n,
        pairs=pairs,
        cdtype=tiling.compute_dtype(lhs.dtype, rhs),
        precision=precision,
        tables=has,
        act=act,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=metadata.varying_struct((lhs_p.shape[0], n // pairs), out_dtype, lhs, rhs, group_sizes, group_offset),
        grid=(sched.group_ids.shape[0], pl.cdiv(n, tn)),
        compiler_params=pl_triton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        cost_estimate=tiling.cost_estimate(lhs, layer, lhs_p.shape[0], out_dtype, glu=act is not None),
    )(sched, tscale, *operands, *(_column_pairs(t, pairs) for t in tables))
    return sched.zero_foreign_rows(out, g_local, m)
