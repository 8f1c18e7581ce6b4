"""Pieces the Mosaic GPU kernels share (`gmm_mosaic_gpu`, `gmm_picks_mgpu`, `linear_mgpu`, `gmm_blackwell`,
`gmm_blackwell_bf16`): Hopper's operand swizzles and SMEM transforms, weight words and their tiles
decoded in registers, the stores of one group's rows of an output tile and of a row tile's rows,
and the Blackwell kernels' TMA / MMA warp pipeline."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import decode


def store_group_rows(tile_smem, out_gmem, offsets, g, m_tile, tm: int, read_only_wait: bool = False):
    """Stores group g's rows of row tile m_tile, tile_smem [tm, N'] (committed), into out_gmem
    [M_pad, N']: rows [offsets[g], offsets[g + 1]) of the tile's, as power-of-two pieces (a TMA
    store is a static shape), so rows of the tile's other groups are never written.
    `read_only_wait`: wait only until the copies have read tile_smem (a scoped buffer about to be
    freed), not until they have written out_gmem."""
    first = jnp.maximum(offsets[g], m_tile * tm) - m_tile * tm
    size = jnp.minimum(offsets[g + 1], (m_tile + 1) * tm) - m_tile * tm - first
    piece, pos = tm, first
    while piece >= 1:

        @pl.when((size & piece) != 0)
        def _(piece=piece, pos=pos):
            plgpu.copy_smem_to_gmem(tile_smem.at[pl.ds(pos, piece)], out_gmem.at[pl.ds(m_tile * tm + pos, piece)])

        pos = pos + (size & piece)
        piece //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=read_only_wait)


def store_rows(y, out_gmem, r, m: int, load, store, *res_smem):
    """y [64, w] (+ the residual's row tile in res_smem) into row tile r of out_gmem [M, w]:
    its M rows, through shared memory by TMA (a box is static: a branch per row tile). load,
    store: `mgpu_api`'s, or the interpreter's plain ref reads and writes."""
    if res_smem:
        y = (load(res_smem[0], plgpu.Layout.WGMMA, False) + y).astype(y.dtype)

    def write(out_smem):
        store(out_smem, y)
        plgpu.commit_smem()
        for i in range(pl.cdiv(m, 64)):
            n = min(64, m - i * 64)
            pl.when(r == i)(
                lambda i=i, n=n: plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, n)], out_gmem.at[pl.ds(i * 64, n)])
            )
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(write, plgpu.SMEM(y.shape, y.dtype))


def warp_pipeline(k_iters: int, steps: int, consumed_bar, done_bar, load, mma):
    """The loop over K of a Blackwell CTA's first warpgroup, a `steps`-deep ring of shared-memory slots:
    warp 0 calls load(ki, slot) (step ki's TMA copies into slot ki % steps) once the MMAs of step
    ki - steps have read the slot (they arrive on consumed_bar[slot]); warp 1 calls mma(ki, slot)
    (waiting on its copies, issuing the step's MMAs) and, after the last step's, commits them to
    done_bar."""

    @plgpu.warp_map
    def _(warp):
        @pl.when(warp == 0)
        def _():
            def copy(ki, _):
                slot = lax.rem(ki, steps)

                @pl.when(ki >= steps)
                def _():
                    plgpu.barrier_wait(consumed_bar.at[slot])

                load(ki, slot)

            lax.fori_loop(0, k_iters, copy, None)

        @pl.when(warp == 1)
        def _():
            def multiply(ki, _):
                mma(ki, lax.rem(ki, steps))

                @pl.when(ki == k_iters - 1)
                def _():
                    plgpu.tcgen05_commit_arrive(done_bar)

            lax.fori_loop(0, k_iters, multiply, None)


def operand_swizzle(cols: int, k: int) -> int:
    """The bf16 operands' swizzle (bytes): the widest a tile of `cols` columns fills whose tiling
    (swizzle / 2 columns) K's `k` columns are whole tiles of, or fewer than one: TMA copies a tiled
    box only out of such an array (Qwen3-30B-A3B's expert slices over 8 devices are K = 96)."""
    swizzle = plgpu.find_swizzle(cols * 16)
    while swizzle > 32 and k > swizzle // 2 and k % (swizzle // 2):
        swizzle //= 2
    return swizzle


def smem_transforms(cols: int, bits: int, swizzle: int | None = None) -> tuple:
    """Shared-memory tiling and swizzle of a tile whose rows are `cols` elements of `bits`: the
    largest swizzle the row fills, or `swizzle` (wgmma wants its two operands' swizzles equal)."""
    swizzle = swizzle or plgpu.find_swizzle(cols * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def decoded_tiles(w_ref, s_refs, *, pairs, fmt, block, cast, load):
    """A step's weight tiles, f32 [rows, width] of values exact in bf16 (an e2m1 code times its
    block scale has at most 6 significant bits): {(column set, K-half): tile}.

    w_ref: the words [rows, width] (bf16 pairs as int32; 4-bit bytes, or byte pairs as uint16);
    s_refs: the two K-halves' scale words [rows / block, width] (4-bit only). Column set i of a
    word is its (i)th bf16 or byte; a byte's K-halves are its low and high nibble."""
    words = cast(w_ref[...], plgpu.Layout.WGMMA).astype(jnp.int32)
    rows, width = w_ref.shape
    if fmt is None:  # bf16 (gate, up) pairs: the f32 bits of a bf16 are its 16 bits << 16
        return {(i, 0): lax.bitcast_convert_type((words >> (16 * i)) << 16, jnp.float32) for i in range(pairs)}
    row = cast(lax.broadcasted_iota(jnp.int32, (rows, width), 0), plgpu.Layout.WGMMA)
    tiles = {}
    for h, s_ref in enumerate(s_refs):
        scale_rows = [load(s_ref.at[b], plgpu.Layout.WGMMA.reduce(0)).astype(jnp.int32) for b in range(rows // block)]
        for i in range(pairs):
            scale = None  # [rows, width] f32: each row's block's scale, by selects down the blocks
            for b, bits in enumerate(scale_rows):
                s = lax.broadcast_in_dim(decode.scale_to_f32((bits >> (8 * i)) & 255, fmt), (rows, width), (1,))
                scale = s if scale is None else jnp.where(row >= b * block, s, scale)
            tiles[i, h] = decode.half_values(words, h, scale, byte=i)
    return tiles


def weight_words(a, pairs: int):
    """[..., N] -> [..., N/p] words of p adjacent elements (a bitcast; p = 2: bf16 pairs as int32,
    byte pairs as uint16)."""
    if pairs == 1:
        return a
    word = {2: jnp.int32, 1: jnp.uint16}[jnp.dtype(a.dtype).itemsize]
    return lax.bitcast_convert_type(a.reshape(*a.shape[:-1], a.shape[-1] // 2, 2), word)
