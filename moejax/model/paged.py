"""The KV cache as pages: one pool of fixed-size pages per cache entry and a block table per
request (vLLM's PagedAttention layout, read through XLA ops that every platform runs).

A pool array holds `pages` pages of `page_size` positions, laid out as the contiguous cache
with its batch axis replaced by pages and its positions by the page's: GQA k/v
[pages, H_kv, page_size, Dh], MLA latent / rope key / DSA indexer keys [pages, page_size, R].
A block table `pages: int32 [B, P]` names each request's pages in order (position p lives in
page table[b, p // page_size] at offset p % page_size); an entry equal to the pool's page count
names no page: reads there are zeros, writes are dropped (padding rows, unwritten tails).

Attention writes a step's keys through the table and reads back the view of the request's
P pages as a contiguous [B, ..., P * page_size, ...] cache, so the masked attention after it
is the contiguous cache's, over the request's live pages only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# In a contiguous cache entry's logical axes, the axes a pool replaces.
CONTIGUOUS_TO_PAGED = {"batch": "pages", "cache_seq": "page_slot"}


def pool_spec(shape: tuple, axes: tuple, pages: int, page_size: int) -> tuple[tuple, tuple]:
    """A contiguous entry's (shape, axes) with batch and positions -> the pool's."""
    sizes = {"batch": pages, "cache_seq": page_size}
    return (tuple(sizes.get(a, n) for n, a in zip(shape, axes)), tuple(CONTIGUOUS_TO_PAGED.get(a, a) for a in axes))


def page_size_of(pool: jax.Array) -> int:
    """Positions per page of a pool array (every entry keeps them just before its last axis)."""
    return pool.shape[-2]


def write(pool: jax.Array, new: jax.Array, positions: jax.Array, table: jax.Array, seq_axis: int) -> jax.Array:
    """pool <- new: [B, T, ...] at positions [B, T] through table [B, P]. seq_axis: the page
    offset's axis in the pool (1: [N, ps, R]; 2: [N, H, ps, Dh] with new [B, T, H, Dh])."""
    ps, n = page_size_of(pool), pool.shape[0]
    page = jnp.take_along_axis(table, positions // ps, axis=1, mode="fill", fill_value=n)  # [B, T]; off the table: none
    index = (page, *[slice(None)] * (seq_axis - 1), positions % ps)
    return pool.at[index].set(new.astype(pool.dtype), mode="drop")


def read(pool: jax.Array, table: jax.Array, seq_axis: int) -> jax.Array:
    """The pages of table [B, P] as a contiguous cache: [B, P*ps, R] (seq_axis 1) or
    [B, H, P*ps, Dh] (seq_axis 2); pages the table does not name read as zeros."""
    pages = pool.at[table].get(mode="fill", fill_value=0)  # [B, P, (H,) ps, ...]
    b, p = table.shape
    if seq_axis == 2:
        pages = jnp.moveaxis(pages, 1, 2)  # [B, H, P, ps, Dh]
        return pages.reshape(b, pages.shape[1], p * pages.shape[3], *pages.shape[4:])
    return pages.reshape(b, p * pages.shape[2], *pages.shape[3:])
