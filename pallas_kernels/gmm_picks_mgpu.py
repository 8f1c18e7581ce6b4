"""A decode step's expert GEMM by pick on Hopper (sm_90) as one Mosaic GPU kernel: the twin of
`gmm_picks.pick_gemm` (jax 0.11 deprecated Pallas's Triton backend), no sort and no group metadata.

The grid is min(G_local, P) x (N tiles): a row of CTAs for each expert a call can touch. CTA (s, j)
multiplies expert g's picks by N tile j, where g is local expert s, or, with fewer picks than local
experts, pick s's expert where s is that expert's first pick (the other CTAs of the row exit at
once: a decode step of a few tokens launches a few CTAs per N tile, not one per expert). It holds
the P pick ids in registers and finds g's picks itself, one at a time, in pick order: the next is
the least pick index after the last whose id is group_offset + g (a min-reduction over the ids). An
expert no pick names has no CTA that finds a pick: its weights are never read. Its picks' rows of
lhs (row(p) = p // k, or p with `rows_are_picks`) lie in row tiles of tm rows; for each tile holding
one of its rows, the CTA runs the Hopper grouped GEMM's tile (`gmm_mosaic_gpu.Product`: TMA pipeline
over K, wgmma, 4-bit weights decoded on the way, the epilogue's scales, bias and act(gate, up)) of
that row tile times the expert's [K, tn] weight columns, and stores, from shared memory by TMA, one
output row per pick: out[p] = the tile's row row(p). Rows are few at decode (lhs is [T, K], T <= tm,
for gate|up, [T*k, K] for down), so the rows go to wgmma as whole row tiles rather than gathered:
Hopper's TMA has no row gather, and a tile of rows costs the MMA what a tile of 64 gathered picks
would. With lhs of at most tm rows (gate|up of up to tm tokens; down of up to tm picks) each
expert's weights are streamed once; with more, once per row tile holding its picks.

The rows of picks of experts outside [group_offset, group_offset + G_local) (other devices') are
zero. With fewer picks than local experts (a decode step of a few tokens) CTA (s, j) writes pick
s's zero row where its expert is not local: one check, and no launch after the kernel. With more,
no CTA writes them: one XLA select after the kernel zeroes them (with the slice of the output's
whole N tiles, as `gmm_mosaic_gpu` zeroes rows of no local group), where a CTA writing them one
at a time would walk most of the picks on an expert-parallel mesh.

The kernel reads its operands as they are, unpadded: the P ids and the lhs rows by TMA boxes
running past their ends, which read zeros there (`gmm_mosaic_gpu.prepare`); an XLA pad would be
one more launch per operand.

rhs may be one layer of a stack (`layered.LayerOf`), read in place; a 4-bit gate|up stack's tensor
scales, one per column, join the epilogue's column scales (a [G_local, N] slice of the layer's).
bf16 rows only (`gmm_mosaic_gpu.refusal`: wgmma multiplies float32 as TF32). Verified here in jax's
Mosaic GPU interpreter and compiled for a compile-only H100 (tests/test_pick_gemm_mgpu.py); not run
on a GPU here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import formats, layered, metadata, mgpu_api, picks
from pallas_kernels.gmm_mosaic_gpu import Product, Tiles, interpret_params, prepare
from pallas_kernels.tiles import round_up

# The kernel's name: its custom call's op_name ends ".../NAME/mpmd_map" (`moejax.compiled.hlo`).
NAME = "pick_gemm_mgpu"
ROW = plgpu.Layout.WGMMA.reduce(1)  # a [64 * i] vector as a [rows, N] tile's rows hold it


def shape_refusal(k: int, n: int, gated: bool, tiles: Tiles) -> str | None:
    """Why a device's [K, N] experts are not this kernel's (`catalog`'s shape check): its TMA boxes
    are swizzled tiles, which K must be whole ones of: of 32 columns at least (64-byte swizzle,
    `operand_swizzle`: Qwen3-30B-A3B's expert slices over 8 devices are K = 96), and N of 64 (a
    model's are). K at least a K step of 64: narrower is compiled by no test here."""
    if k % 32 or k < 64 or n % 64:
        return f"K must be a multiple of 32 from 64 and N of 64 (swizzled tiles), got K={k}, N={n}"
    return None


def table_rows(lhs_rows: int, picks: int, k: int) -> int:
    """The rows the tile table keys a call by (`registry.pick_gemm`): the lhs's, whose row tile it picks."""
    return lhs_rows


# The least N tile the fill rule narrows to: 64 columns (128 bytes of a bf16 weight row, one memory
# transaction); gated, 32 (gate, up) pairs, 128 bytes of their int32 words (a 64-byte output row,
# which the CTA stores from rows 128 bytes apart: a TMA copy's shared memory starts 128-byte aligned).
TN_FLOORS = (64, 64)


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
    """`gmm_picks.pick_gemm`'s product and arguments (its `precision` has no effect: the products
    are bf16's, accumulated in f32), on Mosaic GPU: out [P, N] (with act [P, N/2]) in out_dtype,
    out[p] = lhs[row(p)] @ rhs[ids[p] - group_offset] through the epilogue, zero for picks of
    experts outside the local ones. tiles: `gmm_mosaic_gpu.Tiles` (tm: rows per row tile);
    `interpret`: jax's Mosaic GPU interpreter (on any platform)."""
    del precision
    columns, bias, act = epilogue or (None, None, None)
    picks.check_operands(lhs, rhs, ids, k, rows_are_picks, act)
    p, g_local, n = ids.shape[0], rhs.shape[0], rhs.shape[2]
    rhs, columns = _column_scales(rhs, columns)
    epilogue = None if columns is None and bias is None and act is None else (columns, bias, act)
    prep = prepare(lhs, rhs, out_dtype, tiles, epilogue, interpret, kernel=NAME, padded_rows=True)
    width = prep.product.width
    offset = jnp.asarray(group_offset, jnp.int32).reshape(1)
    leads = min(g_local, p)  # experts a call can touch: a row of CTAs each
    kernel = functools.partial(
        _kernel,
        product=prep.product,
        picks=p,
        experts=g_local,
        rows_per_x=1 if rows_are_picks else k,
        interpret=interpret,
    )
    # The grid as a named scope around the call (`hlo.Instr.programs`): a compiled Mosaic GPU call
    # holds its module as bytecode.
    with jax.named_scope(f"grid_{leads}x{prep.grid_n}"):
        out = plgpu.kernel(
            kernel,
            out_type=metadata.varying_struct((p, prep.grid_n * width), out_dtype, lhs, rhs, ids, group_offset),
            grid=(leads, prep.grid_n),
            grid_names=("s", "n"),
            kernel_name=NAME,
            interpret=interpret_params(interpret),
        )(ids, offset, prep.first, prep.tscale, *prep.operands)
    out = out[:, : n // prep.product.pairs]
    if p < g_local:  # the kernel wrote the picks of other experts' zero rows
        return out
    local = ids - offset[0]
    mine = (local >= 0) & (local < g_local)
    return jnp.where(mine[:, None], out, 0).astype(out_dtype)


def _column_scales(rhs, columns):
    """(rhs without column-wise tensor scales, the epilogue's column scales [G_local, N] times them):
    a 4-bit gate|up stack's NVFP4 tensor scales [G, 1, N] (one per half) scale the product's columns,
    as the epilogue's table does; rhs and columns as they are otherwise."""
    stack = layered.stored(rhs)
    ts = stack.tensor_scale if isinstance(stack, formats.QuantizedArray) else None
    if ts is None or ts.shape[-1] == 1:
        return rhs, columns
    layer = layered.layer_slice(ts, rhs.index) if isinstance(rhs, layered.LayerOf) else ts
    scales = layer.reshape(rhs.shape[0], rhs.shape[2]).astype(jnp.float32)
    scales = scales if columns is None else scales * columns.astype(jnp.float32)
    unscaled = stack.replace(tensor_scale=None)
    return (layered.LayerOf(unscaled, rhs.index) if isinstance(rhs, layered.LayerOf) else unscaled), scales


def _kernel(
    ids_ref, offset_ref, first_ref, tscale_ref, *refs, product: Product, picks: int, experts: int, rows_per_x, interpret
):
    """CTA (s, j): expert g's picks (g: see the module's docstring; `experts`: G_local) times N tile
    j. Refs are whole arrays in GMEM: ids [P] (global expert ids), offset [1] (the first local
    expert), first [1] (its weights in the array read), tscale [G'], `Product`'s operands; out
    [P, W] (W: whole tiles of the product's `width` output columns)."""
    p_pad = round_up(picks, 64)  # ROW's vectors are whole 64-row tiles
    box = min(p_pad, 256)  # a TMA box's most elements along an axis
    boxes = pl.cdiv(p_pad, box)
    # The ids come into shared memory by TMA in boxes running past P, which read zeros there, rather
    # than from a padded copy; the shared ids live as long as the CTA (a scope ending after their
    # load would hand their memory to the pipeline's TMA while other warps may still read them).
    pl.run_scoped(
        functools.partial(
            _cta, ids_ref, offset_ref, first_ref, tscale_ref, *refs, product=product, picks=picks, experts=experts,
            rows_per_x=rows_per_x, interpret=interpret, box=box,
        ),
        plgpu.SMEM((boxes * box,), jnp.int32),
        plgpu.Barrier(num_arrivals=boxes),
    )  # fmt: skip


def _cta(ids_ref, offset_ref, first_ref, tscale_ref, *refs, product, picks, experts, rows_per_x, interpret, box):
    """`_kernel`'s CTA, its scratch last among refs: ids_smem [whole boxes of `box` ids], their barrier."""
    *ins, out_gmem, ids_smem, barrier = refs
    s, n_i = lax.axis_index("s"), lax.axis_index("n")
    tm, width = product.tm, product.width
    p_pad = round_up(picks, 64)

    def copy(b, carry):  # box b; b traced, as a box running past P is no static slice (jax refuses those)
        plgpu.copy_gmem_to_smem(ids_ref.at[pl.ds(b * box, box)], ids_smem.at[pl.ds(b * box, box)], barrier)
        return carry

    lax.fori_loop(0, ids_smem.shape[0] // box, copy, None)
    plgpu.barrier_wait(barrier)
    if interpret:  # the interpreter has no register layouts
        ids, order = ids_smem[:p_pad], lax.broadcasted_iota(jnp.int32, (p_pad,), 0)
    else:
        ids = mgpu_api.load(ids_smem.at[:p_pad], ROW, False)
        order = plgpu.broadcasted_iota(jnp.int32, (p_pad,), 0, layout=ROW)
    # The CTA's expert g: s, or, with fewer picks than experts, pick s's expert where s is its first pick.
    g = s if picks >= experts else ids_ref[s] - offset_ref[0]
    # Picks past P read id 0, which may be a local expert's: they are no pick.
    mine = (ids - offset_ref[0] == g) & (order < picks)

    def after(p):  # () int32: expert g's first pick after pick p; `picks` where none is
        return jnp.min(jnp.where(mine & (order > p), order, picks))

    first = after(-1)
    if picks < experts:  # another CTA leads the picks of g, or g is no local expert
        local = (g >= 0) & (g < experts)
        first = jnp.where(local & (first == s), first, picks)

        @pl.when(~local)
        def _():  # pick s is another device's: its row of N tile j is zero
            def store(zero_smem):  # [64, width]: a wgmma layout's whole rows
                zeros = jnp.zeros((64, width), out_gmem.dtype)
                zero_smem[...] = zeros if interpret else plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(zero_smem.at[pl.ds(0, 1)], out_gmem.at[pl.ds(s, 1), pl.ds(n_i * width, width)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pl.run_scoped(store, plgpu.SMEM((64, width), out_gmem.dtype))

    def tile_of(p):  # the row tile holding pick p's row of lhs
        return p // rows_per_x // tm

    at = first_ref[0] + g  # the expert's weights in the array read

    def row_tile(p):  # p: the expert's first pick in a row tile -> its first pick in a later one
        m_tile = tile_of(p)
        y = product(ins, tscale_ref[at], at=at, local=g, m_tile=m_tile, n_i=n_i, out_dtype=out_gmem.dtype)

        def store(y_smem):  # [tm, spread, width]: each of the tile's picks' row, a TMA copy each
            mgpu_api.store_untiled(y_smem.at[:, 0], y)
            plgpu.commit_smem()

            def one(q):
                row = pl.ds(q // rows_per_x - m_tile * tm, 1)
                plgpu.copy_smem_to_gmem(y_smem.at[row, 0], out_gmem.at[pl.ds(q, 1), pl.ds(n_i * width, width)])
                return after(q)

            nxt = lax.while_loop(lambda q: (q < picks) & (tile_of(q) == m_tile), one, p)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # y_smem is freed after
            return nxt

        # Rows of fewer than 128 bytes (32 gated pairs) lie 128 bytes apart: each copy's rows start aligned.
        spread = max(1, 128 // (width * jnp.dtype(out_gmem.dtype).itemsize))
        return pl.run_scoped(store, plgpu.SMEM((tm, spread, width), out_gmem.dtype))

    lax.while_loop(lambda p: p < picks, row_tile, first)
