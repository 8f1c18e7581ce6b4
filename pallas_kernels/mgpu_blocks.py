"""Pieces the Mosaic GPU grouped GEMMs share (`gmm_mosaic_gpu`, `gmm_blackwell`, `gmm_blackwell_bf16`):
the store of one group's rows of an output tile, and the Blackwell kernels' TMA / MMA warp pipeline."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


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
