"""The layouts of the Mosaic GPU paged decode attention (`paged_attention_mgpu`): the pools' width,
a page's copied rows, the query rows a kv head holds, a split's partials and the SMEM they take.

Mosaic GPU's shapes, and what is padded or masked:
- a TMA copy moves a multiple of 128 bytes (one per thread of the warpgroup) and lands on SMEM
  tiles of 8 rows: a page's copy is its page_size rows rounded up to 8 (`page_rows`); the rows
  after the page (the next kv head's or page's) are masked, and the last page of the pool,
  which has no rows after it, is read from as many rows earlier and masked before;
- W (the pool's width) is whole 32-byte swizzle granules: `pool_width` pads Dh (64, 80 or 128
  in bf16 need none, 24 is read as 32); its zero columns add nothing to q.k, and only Dh
  columns are returned;
- a compute block's rows (`pages_per_block * page_rows`) are padded to the register tile's 64
  (rows never written, masked);
- the query heads per kv head are padded to whole 128-byte copies, and to a tile of whole
  rounds of the warpgroup's threads (`query_rows`); the padded heads are never computed;
- a split's partial is [2, query rows, W] f32: its heads' normalized outputs, then their
  log-sum-exps, each across its head's row (the combine's arithmetic is elementwise).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_kernels.tiles import round_up

ROWS = 64  # the register tile's rows (the WGMMA layout's): a compute block's positions are padded to it
TILE_ROWS = 8  # an SMEM tile's rows: each page's copy starts on one
COPY_BYTES = 128  # a TMA copy's granule: a byte per thread of the warpgroup (Mosaic GPU's lowering)
WARPGROUP = 128  # threads: a strided register tile's elements are whole rounds of them
GRANULE = 32  # bytes: the least swizzle, so a pool row is whole granules of it
SMEM_BYTES = 227 * 1024  # an H100 CTA's most shared memory


def pool_width(dh: int, dtype) -> int:
    """The pools' head width W for heads of dh: whole 32-byte swizzle granules (zeros after dh)."""
    return round_up(dh, GRANULE // jnp.dtype(dtype).itemsize)


def page_rows(page_size: int) -> int:
    """The rows a page's copy moves: page_size rounded up to whole SMEM tiles."""
    return round_up(page_size, TILE_ROWS)


def whole_copies(n: int, row_bytes: int) -> int:
    """The least m >= n for which m rows of row_bytes are whole TMA copies."""
    return n + (-n) % (COPY_BYTES // math.gcd(COPY_BYTES, row_bytes))


def query_rows(groups: int, w: int, dtype) -> int:
    """Query heads per kv head as the kernel holds them: G padded to whole copies of q (dtype), and
    to a [rows, W] tile the warpgroup's 128 threads share evenly (the combine's strided layout)."""
    return math.lcm(whole_copies(groups, w * jnp.dtype(dtype).itemsize), WARPGROUP // math.gcd(WARPGROUP, w))


def smem_bytes(groups: int, w: int, page_size: int, pages_per_block: int, splits: int, dtype) -> int:
    """The SMEM the kernel's buffers take (an H100's CTA may hold 227 KB)."""
    itemsize = jnp.dtype(dtype).itemsize
    gq = query_rows(groups, w, dtype)
    block = round_up(pages_per_block * page_rows(page_size), ROWS)
    kv = 2 * 2 * block * w * itemsize  # k and v, two slots
    partials = partials_chunk(splits) * 2 * gq * w * 4  # a split's partial: [2, gq, W] f32
    return kv + gq * w * (itemsize + 4) + partials


# The other splits' partials the combining CTA holds at a time (SMEM holds a few of them, not 60),
# and the most SMEM they take where a partial is wide (MLA's heads of the latent's 512).
PARTIALS_CHUNK = 8
PARTIALS_BYTES = 64 * 1024


def partials_chunk(splits: int, partial_bytes: int = 0) -> int:
    """The partials a copy brings to the combining CTA: every other split's, at most PARTIALS_CHUNK
    and (given a partial's bytes) as many as PARTIALS_BYTES hold, at least one."""
    most = PARTIALS_CHUNK if not partial_bytes else max(1, min(PARTIALS_CHUNK, PARTIALS_BYTES // partial_bytes))
    return min(max(splits - 1, 1), most)


def latent_query_rows(heads: int, widths: tuple[int, ...], dtype) -> int:
    """MLA's query heads per CTA as the kernel holds them: the least count from `heads` that is
    `query_rows` of itself at each of the query's widths (the latent's C and the rope's R)."""
    n = heads
    while any(query_rows(n, w, dtype) != n for w in widths):
        n += 1
    return n


def latent_smem_bytes(heads: int, c: int, r: int, page_size: int, pages_per_block: int, splits: int, dtype) -> int:
    """The SMEM the MLA kernel's buffers take for `heads` query heads per CTA over a latent of c
    and a rope key of r: two slots of a block's latent, rope keys and kept flags (a chunk of
    partials after them, in the same SMEM), the queries (then the outputs) and the weighted latents."""
    itemsize = jnp.dtype(dtype).itemsize
    gq = latent_query_rows(heads, (c, r), dtype)
    block = round_up(pages_per_block * page_rows(page_size), ROWS)
    slots = 2 * block * ((c + r) * itemsize + 4)
    partial = 2 * gq * c * 4
    return max(slots, partials_chunk(splits, partial) * partial) + gq * (c + r) * itemsize + gq * c * 4
