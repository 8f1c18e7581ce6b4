"""A decode step's expert GEMM by pick: no sort, no group metadata, one Triton launch per product.

At decode sizes (a few hundred picks) a kernel finds each expert's picks itself. The grid is
(G_local + 1) x (N tiles). Program (g, j), g < G_local, compares the P pick ids with its expert's,
group_offset + g, and ranks the matches with a cumsum; it then walks its picks in chunks of tm
(picks past the last masked): it gathers their rows of lhs, runs the K loop against its expert's
[K, tn] tile (4-bit tiles decoded in registers, as two K-halves), applies the epilogue (tensor
and column scales, bias, act over (gate, up) column pairs) and stores each row at its pick's row of
the output. An expert no pick names has no chunk: its program returns at once and its weights are
never read; with tm picks or fewer, an expert's weights are read once. The last row of programs,
g = G_local, writes zeros to the rows of picks of experts outside [group_offset, group_offset +
G_local) (other devices' experts), so every row of the output is written by exactly one program
per column tile and the product needs no other launch.

K and N take any width: an edge tile's loads read zeros past the width and its stores write
nothing, masks built only where a width is not a multiple of its tile (as `gmm_pallas_gpu`).
rhs may be one layer of a run's stack (`layered.LayerOf`), read where it lies (`layered.flat`).

`pick_gemm_xla` is the same product in plain XLA, every pick's expert gathered whole: the kernel's
reference, not a decode path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import decode, formats, layered, metadata, picks, tiling
from pallas_kernels.epilogue import finish, gate_up_columns, glu
from pallas_kernels.triton_blocks import column_pairs, iota, load


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A pick_gemm's blocks and launch settings (the caller's choice, by rows, K, N, format and
    device: `tiles.lookup("pick_gemm", ..)`). Blocks are powers of two and every dot's dims at least 16:
    tm >= 16; tk >= 16 (4-bit: two K-halves of tk / 2 >= 16 values, whole scale blocks); tn >= 16
    output columns (with an activation tn / 2, tn counting gate and up columns)."""

    tn: int  # weight columns a program writes
    tk: int  # K per step of the K loop
    tm: int  # picks per chunk
    num_warps: int
    num_stages: int


def _check(lhs, rhs, ids, k: int, rows_are_picks: bool, tiles: Tiles, act) -> None:
    """One clear error for operands or tiles the kernel cannot take."""
    picks.check_operands(lhs, rhs, ids, k, rows_are_picks, act)
    stack = layered.stored(rhs)
    block = stack.spec.block if isinstance(stack, formats.QuantizedArray) else 0
    floors = {"tm": 16, "tk": max(16, 2 * block), "tn": 32 if act is not None else 16}
    for name, floor in floors.items():
        size = getattr(tiles, name)
        if size < floor or size & (size - 1):
            raise ValueError(f"pick_gemm: tiles.{name}={size} must be a power of two of at least {floor}")


def table_rows(lhs_rows: int, picks: int, k: int) -> int:
    """The rows the tile table keys a call by (`registry.pick_gemm`): its tokens, vLLM's M."""
    return picks // k


TN_FLOORS = (16, 32)  # the least N tile the fill rule narrows to: without, with a gated epilogue


def pick_gemm(
    lhs,
    rhs,
    ids,
    *,
    k: int,
    group_offset,
    out_dtype,
    epilogue=None,
    rows_are_picks: bool = False,
    tiles: Tiles,
    precision=None,
    interpret: bool = False,
):
    """out[p] = lhs[row(p)] @ rhs[ids[p] - group_offset] for the P picks ids [P] (int32, a [T, k]
    router's picks flattened, global expert ids), with row(p) = p // k (lhs [T, K]: the gate|up
    product of each pick's token) or, `rows_are_picks`, p (lhs [P, K]: the down product).

    rhs: the local experts [group_offset, group_offset + G) as [G, K, N] (an array, or a 4-bit
    `formats.QuantizedArray` quantized along K, its NVFP4 tensor scales one per expert or one per
    column), or either as one layer of a stack (`layered.LayerOf`). group_offset: scalar, may be
    traced. epilogue: (column scales [G, N] or None, bias [G, N] or None, act or None), as
    `gmm_pallas_gpu` takes it: act(gate, up) of (product * scales + bias) over the interleaved
    (gate, up) column pairs -> [P, N/2]. precision: the products' (jnp.dot's; "highest": f32 at
    full precision, not TF32). tiles: the blocks and launch settings (`Tiles`); interpret: run in
    Pallas' interpreter, on any platform. Returns [P, N] (with act [P, N/2]) in out_dtype; the rows
    of picks of experts outside the local ones are zero.
    """
    columns, bias, act = epilogue or (None, None, None)
    _check(lhs, rhs, ids, k, rows_are_picks, tiles, act)
    p, kdim = ids.shape[0], lhs.shape[1]
    g_local, _, n = rhs.shape
    # The layer's weights as abstract arrays: what the call reads, for its cost.
    layer = jax.eval_shape(layered.layer_slice, rhs.stack, 0) if isinstance(rhs, layered.LayerOf) else rhs
    rhs, first = layered.flat(rhs)
    quantized = isinstance(rhs, formats.QuantizedArray)
    pairs = 1 if act is None else 2
    ts = rhs.tensor_scale if quantized else None  # NVFP4's: [G', 1, 1] one per expert, or [G', 1, N] per column
    per_column = ts is not None and ts.shape[-1] != 1  # a gate_up stack's: one per half
    scales = [] if ts is None else [column_pairs(ts, pairs) if per_column else tiling.tensor_scales(rhs)]
    if quantized:
        weights = (column_pairs(rhs.values, pairs), column_pairs(tiling.scale_bits(rhs), pairs))
        fmt, block = rhs.fmt, rhs.spec.block
    else:
        weights, fmt, block = (column_pairs(rhs, pairs),), None, 1
    tables = [column_pairs(t.reshape(g_local, 1, n), pairs) for t in (columns, bias) if t is not None]
    kernel = functools.partial(
        _kernel,
        p=p,
        rows_per_x=1 if rows_are_picks else k,
        g_local=g_local,
        kdim=kdim,
        n=n,
        pairs=pairs,
        tiles=tiles,
        fmt=fmt,
        block=block,
        cdtype=tiling.compute_dtype(lhs.dtype, rhs),
        precision=precision,
        per_column=per_column,
        has=(ts is not None, columns is not None, bias is not None),
        act=act,
    )
    operands = (ids, jnp.asarray(group_offset, jnp.int32).reshape(1), first, lhs, *weights, *scales, *tables)
    # ids as one block of the power of two covering P (Triton's blocks are powers of two; the tail
    # masked), the rest whole.
    whole = pl.BlockSpec()
    return pl.pallas_call(
        kernel,
        out_shape=metadata.varying_struct((p, n // pairs), out_dtype, lhs, rhs, ids, group_offset),
        grid=(g_local + 1, pl.cdiv(n, tiles.tn)),
        in_specs=[pl.BlockSpec((pl.next_power_of_2(p),), lambda g, j: (0,))] + [whole] * (len(operands) - 1),
        out_specs=whole,
        compiler_params=pl_triton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        cost_estimate=tiling.cost_estimate(
            jax.ShapeDtypeStruct((p, kdim), lhs.dtype), layer, p, out_dtype, act is not None
        ),
    )(*operands)


def _kernel(
    ids_ref,
    offset_ref,
    first_ref,
    x_ref,
    *refs,
    p,
    rows_per_x,
    g_local,
    kdim,
    n,
    pairs,
    tiles,
    fmt,
    block,
    cdtype,
    precision,
    per_column,
    has,
    act,
):
    """Program (g, j): expert g's picks (g = g_local: the picks of no local expert) times column
    tile j. Refs are whole arrays in HBM but ids, [P_pad] (a block past P); offset [1], first [1]
    (the layer's first expert in the stack's [G', ..]), x [P / rows_per_x, K], the weights
    ([G', K, N/p, p], or 4-bit bytes [G', K/2, N/p, p] and scale bits [G', K/B, N/p, p]; p = `pairs`:
    2 with act, the gate and up columns), then where `has` says: the tensor scales ([G'], or
    `per_column` [G', 1, N/p, p]), the epilogue's column scales and bias [G, 1, N/p, p]; out [P, N/p]."""
    *ins, out_ref = refs
    n_weights = 1 if fmt is None else 2
    w_refs, extras = ins[:n_weights], iter(ins[n_weights:])
    tscale_ref, cols_ref, bias_ref = (next(extras) if present else None for present in has)
    g, n_i = pl.program_id(0), pl.program_id(1)  # read outside pl.when: interpret mode wants it
    tm, width, out_cols = tiles.tm, tiles.tn // pairs, n // pairs
    p_pad = ids_ref.shape[0]  # the power of two covering P
    in_p = lax.iota(jnp.int32, p_pad) < p
    local = load(ids_ref, None if p_pad == p else in_p) - offset_ref[0]  # [P_pad]
    cols = iota(width, 1, n_i * width)  # [1, width]: the output columns (column pairs) of this program
    in_n = None if out_cols % width == 0 else cols < out_cols
    at = first_ref[0] + g  # the expert's weights in the stack
    w_cols = pl.ds(n_i * width, width)
    # A load's K span: the K-halves' of 4-bit bytes, else K's.
    kk, kt = (kdim // 2, tiles.tk // 2) if fmt else (kdim, tiles.tk)

    def chunks(mine, body):
        """body(rows [tm, 1], real [tm, 1]) for each chunk of tm of the picks `mine` [P_pad] marks,
        in pick order: their pick indices (P, past the output, where the chunk runs past the last
        one) and which are picks. A chunk's picks are those whose rank among the marked (a cumsum)
        is one of its tm slots."""
        rank = jnp.cumsum(mine.astype(jnp.int32)) - 1  # [P_pad]
        count = jnp.sum(mine.astype(jnp.int32))
        picks = lax.broadcasted_iota(jnp.int32, (1, p_pad), 1)

        def chunk(c, carry):
            slots = iota(tm, 0, c * tm)  # [tm, 1]
            found = mine[None, :] & (rank[None, :] == slots)  # [tm, P_pad]: at most one pick a slot
            real = slots < count
            body(jnp.where(real, jnp.sum(jnp.where(found, picks, 0), axis=1, keepdims=True), p), real)
            return carry

        lax.fori_loop(0, pl.cdiv(count, tm), chunk, 0)  # no picks: no trip, the weights unread

    def in_k(k0, size, per, axis):  # [size, 1] or [1, size]: which of `size` units of `per` K rows from k0 lie in K
        return None if kk % kt == 0 else iota(size, axis, k0 // per) < kk // per

    def dot(a, b):  # f32 products of the compute dtype
        return jnp.dot(a.astype(cdtype), b.astype(cdtype), preferred_element_type=jnp.float32, precision=precision)

    def product(rows, real):  # one chunk of expert g's picks: rows [tm, 1] of out (real: [tm, 1])
        x_rows = rows // rows_per_x  # [tm, 1]

        def x_tile(half, k0):  # [tm, kt]: the picks' rows of x, K from half + k0
            return load(x_ref.at[x_rows, iota(kt, 1, half + k0)], real, in_k(k0, kt, 1, 1))

        def k_step(k_i, i):  # [tm, width] f32: one K step of the rows times column set i
            k0 = k_i * kt
            if fmt:
                v_ref, s_ref = w_refs
                sb, s_in = kt // block, in_k(k0, kt // block, block, 0)
                w_lo, w_hi = decode.decode_tile(
                    load(v_ref.at[at, pl.ds(k0, kt), w_cols, i], in_k(k0, kt, 1, 0), in_n),
                    load(s_ref.at[at, pl.ds(k0 // block, sb), w_cols, i], s_in, in_n),
                    load(s_ref.at[at, pl.ds((kk + k0) // block, sb), w_cols, i], s_in, in_n),
                    block,
                    fmt,
                )
                return dot(x_tile(0, k0), w_lo) + dot(x_tile(kk, k0), w_hi)
            (w_ref,) = w_refs
            return dot(x_tile(0, k0), load(w_ref.at[at, pl.ds(k0, kt), w_cols, i], in_k(k0, kt, 1, 0), in_n))

        def step(k_i, accs):  # accs: one [tm, width] f32 per column set
            return tuple(acc + k_step(k_i, i) for i, acc in zip(sets, accs))

        accs = lax.fori_loop(0, pl.cdiv(kk, kt), step, tuple(jnp.zeros((tm, width), jnp.float32) for _ in sets))
        ys = [
            finish(acc, out_ref.dtype, scale(i), None if bias_ref is None else load(bias_ref.at[g, :, w_cols, i], in_n))
            for i, acc in zip(sets, accs)
        ]
        # Triton has no bf16 division (the sigmoid's): the activation's math is f32.
        y = ys[0] if act is None else glu(*(y.astype(jnp.float32) for y in ys), act).astype(out_ref.dtype)
        store(rows, real, y)

    def scale(i):  # [1, width], () or None: column set i's tensor scales (per column or the expert's) x column scales
        t = None
        if tscale_ref is not None:
            t = load(tscale_ref.at[at, :, w_cols, i], in_n) if per_column else tscale_ref[at]
        if cols_ref is not None:
            c = load(cols_ref.at[g, :, w_cols, i], in_n)
            t = c if t is None else t * c
        return t

    def store(rows, real, y):  # y [tm, width] into the picks' rows `rows` [tm, 1] that are `real`
        pl_triton.store(out_ref.at[rows, cols], y, mask=real if in_n is None else real & in_n)

    # The column sets (all columns, or the gate and the up ones) as array indices: interpret
    # mode's masked loads take no Python int.
    sets = [jnp.int32(i) for i in range(pairs)]

    @pl.when(g < g_local)
    def _():
        chunks(in_p & (local == g), product)

    @pl.when(g == g_local)
    def _():  # the picks of other devices' experts: zero rows
        zeros = jnp.zeros((tm, width), out_ref.dtype)
        chunks(in_p & ((local < 0) | (local >= g_local)), lambda rows, real: store(rows, real, zeros))


def pick_gemm_xla(
    lhs, rhs, ids, *, k: int, group_offset, out_dtype, epilogue=None, rows_are_picks=False, precision=None
):
    """`pick_gemm`'s product in plain XLA (its arguments, less the tiles): each pick's expert
    gathered whole and decoded to f32 with its tensor scales, then the same epilogue."""
    columns, bias, act = epilogue or (None, None, None)
    w = layered.layer_slice(rhs.stack, rhs.index) if isinstance(rhs, layered.LayerOf) else rhs
    w = formats.dequantize(w) if isinstance(w, formats.QuantizedArray) else w.astype(jnp.float32)  # [G, K, N]
    local = ids - jnp.asarray(group_offset, jnp.int32)  # [P]
    mine = (local >= 0) & (local < w.shape[0])
    local = jnp.clip(local, 0, w.shape[0] - 1)
    x = lhs if rows_are_picks else lhs[jnp.arange(ids.shape[0]) // k]  # [P, K]
    y = jnp.einsum("pk,pkn->pn", x.astype(jnp.float32), w[local], precision=precision)
    y = finish(y, out_dtype, None if columns is None else columns[local], None if bias is None else bias[local])
    if act is not None:
        y = glu(*(c.astype(jnp.float32) for c in gate_up_columns(y)), act).astype(out_dtype)
    return jnp.where(mine[:, None], y, 0).astype(out_dtype)
