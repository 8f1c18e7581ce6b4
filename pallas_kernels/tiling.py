"""Tile schedules and operand views shared by the Pallas kernels (which tiles a call takes, and the
sizes' arithmetic, are `tiles.py`'s)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.tpu.megablox.gmm import make_group_metadata

from pallas_kernels import formats
from pallas_kernels.tiles import round_up


def cost_estimate(lhs, rhs, out_rows: int, out_dtype, glu: bool = False) -> pl.CostEstimate:
    """What a grouped GEMM costs, for XLA to schedule around the call (as megablox tells it):
    every row of lhs [M, K] times one [K, N] expert; bytes of lhs, of rhs [G, K, N] (at most:
    experts without rows are not read) and of the [out_rows, N] output ([out_rows, N/2] and
    one sigmoid per output with the gated activation in the epilogue)."""
    m, k = lhs.shape
    n = rhs.shape[2]
    out_cols = n // 2 if glu else n
    out_bytes = out_rows * out_cols * jnp.dtype(out_dtype).itemsize
    return pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=m * out_cols if glu else 0,
        bytes_accessed=formats.nbytes(lhs) + formats.nbytes(rhs) + out_bytes,
    )


def group_tiles(lhs: jax.Array, group_sizes: jax.Array, group_offset, g_local: int, tm: int):
    """The tile schedule both Pallas kernels walk: megablox's metadata over the active [tm]-row
    tiles of the local groups [group_offset, group_offset + g_local).

    Returns lhs_p [M_pad, K] (pad rows are in no group), offset [1], megablox's
    (offsets [G + 1], group_ids, m_tile_ids) and num_tiles.
    """
    lhs_p = pad_rows(lhs, tm)
    return (lhs_p, *schedule(group_sizes, group_offset, g_local, lhs_p.shape[0], tm))


class Schedule(NamedTuple):
    """A GPU grouped GEMM's walk over its row tiles (`gpu_schedule`), handed to its kernel as one
    operand: refs inside the kernel, arrays outside. The grid's first axis runs over every tile
    the schedule may hold; tile t < num_tiles[0] holds rows of group group_ids[t]."""

    num_tiles: jax.Array  # [1] the active tiles
    group_ids: jax.Array  # [T] each tile's group
    m_tile_ids: jax.Array  # [T] each tile's row tile
    offsets: jax.Array  # [G + 1] each group's first row (megablox's)
    offset: jax.Array  # [1] the first local group
    first: jax.Array  # [1] where the local groups' weights start in the array read (`layered.flat`)

    def active(self, t):
        return t < self.num_tiles[0]

    def tile(self, t):
        """Tile t -> its group g, g's place among the local groups, its row tile, and g's weights'
        index in the array read."""
        g = self.group_ids[t]
        local = g - self.offset[0]
        return g, local, self.m_tile_ids[t], self.first[0] + local

    def zero_foreign_rows(self, out: jax.Array, g_local: int, m: int) -> jax.Array:
        return zero_foreign_rows(out, self.offsets, self.offset[0], g_local, m)


def gpu_schedule(group_sizes: jax.Array, group_offset, g_local: int, m_pad: int, tm: int, first) -> Schedule:
    """`schedule` as the GPU kernels take it, with the weights' first local group `first` [1]."""
    offset, (offsets, group_ids, m_tile_ids), num_tiles = schedule(group_sizes, group_offset, g_local, m_pad, tm)
    return Schedule(num_tiles.reshape(1), group_ids, m_tile_ids, offsets, offset, first)


def pad_rows(lhs: jax.Array, tm: int) -> jax.Array:
    """lhs [M, K] -> [M_pad, K], M_pad a multiple of tm (pad rows are in no group)."""
    return jnp.pad(lhs, ((0, round_up(lhs.shape[0], tm) - lhs.shape[0]), (0, 0)))


def schedule(group_sizes: jax.Array, group_offset, g_local: int, m_pad: int, tm: int):
    """`group_tiles`' schedule of M_pad rows (a multiple of tm) -> offset [1], (offsets [G + 1],
    group_ids, m_tile_ids) and num_tiles; the local groups' tiles come first, at most
    M_pad / tm + g_local - 1 of them."""
    offset = jnp.asarray(group_offset, jnp.int32).reshape(1)
    metadata, num_tiles = make_group_metadata(
        group_sizes=group_sizes,
        m=m_pad,
        tm=tm,
        start_group=offset[0],
        num_nonzero_groups=g_local,
        visit_empty_groups=False,
    )
    return offset, metadata, num_tiles


def scale_bits(q: formats.QuantizedArray) -> jax.Array:
    """Scales as uint8 bits [G, K/B, N]: the kernels decode them with integer ops."""
    return jax.lax.bitcast_convert_type(q.scales, jnp.uint8)


def tensor_scales(q: formats.QuantizedArray) -> jax.Array:
    """[G] f32 per-group tensor scale (1 for MXFP4). Column-wise scales are applied outside the
    kernels (`registry.grouped_gemm`)."""
    if q.tensor_scale is None:
        return jnp.ones(q.values.shape[:1], jnp.float32)
    if q.tensor_scale.shape[-1] != 1:
        raise ValueError(f"kernel tensor scales are one per group, got {q.tensor_scale.shape}")
    return q.tensor_scale.reshape(-1).astype(jnp.float32)


def compute_dtype(lhs_dtype, rhs) -> jnp.dtype:
    """bf16 math when the rows are bf16 (4-bit weights are decoded to it), else f32."""
    rhs_dtype = lhs_dtype if isinstance(rhs, formats.QuantizedArray) else rhs.dtype
    both_bf16 = jnp.dtype(lhs_dtype) == jnp.bfloat16 and jnp.dtype(rhs_dtype) == jnp.bfloat16
    return jnp.dtype(jnp.bfloat16 if both_bf16 else jnp.float32)


def zero_foreign_rows(out: jax.Array, offsets: jax.Array, first_group, g_local: int, m: int) -> jax.Array:
    """out [M_pad, N] -> [M, N] with rows no local group owns set to 0.

    The kernels never write those rows (their memory is uninitialized); offsets [G + 1] are
    megablox's group row offsets, local groups are [first_group, first_group + g_local).
    """
    rows = jnp.arange(m)[:, None]
    mine = (rows >= offsets[first_group]) & (rows < offsets[first_group + g_local])
    return jnp.where(mine, out[:m], 0).astype(out.dtype)


def epilogue_tables(epilogue, g_local: int) -> tuple[list[jax.Array], tuple[bool, bool], str | None]:
    """A fused epilogue's per-group column tables (column scales, bias: [G_local, N], where
    present) as [G_local, 1, N] kernel operands, which of the two are there, and its activation."""
    columns, bias, act = epilogue or (None, None, None)
    tables = [t.reshape(g_local, 1, -1) for t in (columns, bias) if t is not None]
    return tables, (columns is not None, bias is not None), act
