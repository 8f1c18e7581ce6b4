"""The KV cache as pages: one pool of fixed-size pages per cache entry and a block table per
request (vLLM's PagedAttention layout, read through XLA ops that every platform runs).

A pool array holds `pages` pages of `page_size` positions, laid out as the contiguous cache
with its batch axis replaced by pages and its positions by the page's: GQA k/v
[pages, H_kv, page_size, Dh], MLA latent / rope key / DSA indexer keys [pages, page_size, R].
A block table `pages: int32 [B, P]` names each request's pages in order (position p lives in
page table[b, p // page_size] at offset p % page_size); an entry equal to the pool's page count
names no page: reads there are zeros, writes are dropped (padding rows, unwritten tails).
A run of layers stacks its pools [layers, pages, ...]; a layer writes and reads its own through
its index (`LayerPages`), in place.

A model with sliding-window layers keeps two page groups (vLLM's hybrid KV-cache manager): its
full-attention layers' pools and block tables, and its window layers' own pools (entries named
WINDOW + name, sized apart) and tables (`Tables`). A window table is indexed as a full one (page
p // page_size) but names no page where every position fell out of the window: those pages went
back to the window pool. Each layer reads and writes its own group's pool (`GroupPages`).

Attention writes a step's keys through the table and reads back the view of the request's
P pages as a contiguous [B, ..., P * page_size, ...] cache, so the masked attention after it
is the contiguous cache's, over the request's live pages only. With a Pallas paged-attention
kernel (`pallas_kernels/paged_attention.py`) the kernel reads the pages itself, per
device (`store_and_attend`); TPU's wants one pool "kv" [pages, page_size, 2 * H_kv, Dh padded
to 128] of each position's keys and values interleaved by head, written here and read by that
kernel only, and reads no sinks or windows (`kernel_refusal`); the GPU's (Mosaic GPU) reads MLA's
latent and rope key pools as they lie (`store_and_attend_latent`), and GQA's
pools k, v with Dh padded to whole 32-byte granules (`kernels.head_dim`), which the XLA path
reads too (a prefill chunk's attention) as zeros after each head's Dh, and masks a window
layer's window and adds its sinks itself: a window layer's decode step reads its own group's
pool and tables.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import paged_attention as kernels

# In a contiguous cache entry's logical axes, the axes a pool replaces.
CONTIGUOUS_TO_PAGED = {"batch": "pages", "cache_seq": "page_slot"}
KV_POOL_AXES = ("pages", "page_slot", "kv_heads", "head_dim")  # the interleaved "kv" pool's


class LayerPages(NamedTuple):
    """One layer's view of its run's pools [layers, pages, ...]: the block tables [B, P] and the
    layer's index. The layer writes and reads its slice in place: a slice taken out and put back
    copies the layer's whole pool every step (the pool is most of an accelerator's memory)."""

    table: jax.Array
    layer: jax.Array | int


WINDOW = "window_"  # the name prefix of a sliding-window layer's pool entries (its own page group)


class Tables(NamedTuple):
    """A model with sliding-window layers' block tables [B, P] (or page ids [K]) per page group:
    its full-attention layers' and its window layers' (their own pool; none out of the window)."""

    full: jax.Array
    window: jax.Array


class GroupPages(NamedTuple):
    """One layer of a model with window layers: both groups' tables, the layer's index in its own
    group's pools [layers, pages, ...], and whether it is a window layer (a Python bool where the
    loop knows it, else traced: a scan over mixed layers)."""

    tables: Tables
    layer: jax.Array | int
    window: jax.Array | bool

    def group(self, window: bool) -> tuple[str, LayerPages]:
        """(the entries' name prefix, the layer's pages) in the window group or the full one."""
        return (
            (WINDOW, LayerPages(self.tables.window, self.layer))
            if window
            else ("", LayerPages(self.tables.full, self.layer))
        )


def in_window(name: str) -> bool:
    return name.startswith(WINDOW)


def base(name: str) -> str:
    """A pool entry's name without its group's prefix (both groups' entries lie alike)."""
    return name[len(WINDOW) :] if in_window(name) else name


def ids_for(ids, name: str):
    """Page ids (or tables) of entry `name`'s group: a `Tables`' window or full ones, or `ids` itself."""
    if isinstance(ids, Tables):
        return ids.window if in_window(name) else ids.full
    return ids


def width(pages) -> int:
    """P of block tables [B, P] (a bare table, or a `Tables`' both)."""
    return (pages.full if isinstance(pages, Tables) else pages).shape[1]


def narrow(pages, n: int):
    """Block tables' first n pages (every group's)."""
    return jax.tree.map(lambda t: t[:, :n], pages)


def _at(pages) -> tuple[tuple, jax.Array]:
    """(the index prefix of the layer, the tables): LayerPages into stacked pools, or a bare table
    [B, P] into one pool [pages, ...]."""
    return ((pages.layer,), pages.table) if isinstance(pages, LayerPages) else ((), pages)


def pool_spec(shape: tuple, axes: tuple, pages: int, page_size: int, head_dim: int = 0) -> tuple[tuple, tuple]:
    """A contiguous entry's (shape, axes) with batch and positions -> the pool's; `head_dim`: its
    heads' width where a kernel reads them wider (`kernels.head_dim`; 0: the entry's own)."""
    sizes = {"batch": pages, "cache_seq": page_size} | ({"head_dim": head_dim} if head_dim else {})
    return (tuple(sizes.get(a, n) for n, a in zip(shape, axes)), tuple(CONTIGUOUS_TO_PAGED.get(a, a) for a in axes))


def widen(x: jax.Array, width: int) -> jax.Array:
    """x [..., Dh] with zeros after its last axis up to a pool's head width `width`."""
    return x if x.shape[-1] == width else jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, width - x.shape[-1]),))


def page_size_of(cache) -> int:
    """Positions per page of a pool (a run's dict of entries, or a list of them): the axis
    before the last, but for the interleaved "kv" pool's [.., page_size, 2 * H_kv, Dh]."""
    run = cache[0] if isinstance(cache, (list, tuple)) else cache
    return run["kv"].shape[-3] if "kv" in run else next(iter(run.values())).shape[-2]


def kernel_refusal(c, kernel: str, dtype) -> str | None:
    """Why paged-attention `kernel` cannot read this model's cache in `dtype` (None: it can). MLA
    caches a latent, which only the GPU kernel reads (rows of whole granules); the TPU kernel's
    softmax has no sink logit and masks no sliding window."""
    if c.is_mla:
        if not kernels.reads_latent(kernel):
            return "MLA and DSA cache one latent per position, not GQA heads"
        return kernels.latent_refusal(c.kv_lora_rank, c.qk_rope_head_dim, dtype)
    if (c.attention_sinks or c.sliding_layers) and not kernels.reads_windows(kernel):
        return "its softmax takes no attention sinks or sliding windows"
    return None


def kv_pool_spec(c, pages: int, page_size: int, kernel: str, dtype) -> dict:
    """The interleaved "kv" pool of a kernel that reads one (`kernels.combined`): name -> (shape, axes)."""
    dh = kernels.head_dim(kernel, c.head_dim, dtype)
    return {"kv": ((pages, page_size, 2 * c.num_kv_heads, dh), KV_POOL_AXES)}


def local(table: jax.Array, first_page, n: int) -> jax.Array:
    """A device's view of block tables of global page ids: its pages first_page .. first_page + n - 1
    as 0 .. n - 1, any other page (another rank's, or none) as n (none here: reads zeros, writes dropped)."""
    table = table - first_page
    return jnp.where((table >= 0) & (table < n), table, n)


def copy(pool: jax.Array, source: jax.Array, target: jax.Array) -> jax.Array:
    """A run's pool [layers, pages, ...] with pages `source` [F] copied into `target` [F] (id N: none)."""
    return pool.at[:, target].set(pool.at[:, source].get(mode="fill", fill_value=0), mode="drop")


def store(first_page, pool: jax.Array, new: jax.Array, positions: jax.Array, pages, seq_axis: int, view: bool = True):
    """One device's `write` of new [B, T, ...] through `pages` (global page ids; this device holds
    pages first_page.. of `pool`) and, `view` True, its `read` back -> (pool, view) or pool."""
    lead, table = _at(pages)
    table = local(table, first_page, pool.shape[len(lead)])
    pages = LayerPages(table, pages.layer) if lead else table
    pool = write(pool, new, positions, pages, seq_axis)
    return (pool, read(pool, pages, seq_axis)) if view else pool


def store_and_attend(
    kernel: str,
    scale: float,
    window: int,
    first_page,
    q,
    k,
    v,
    positions,
    pages: LayerPages,
    pool: dict,
    sinks=None,
    *,
    device: tuple[str, int] = ("", 0),
):
    """One device's requests and pages: writes k, v: [B, T, H_kv, Dh] (a kernel reading the
    interleaved pool, `kernels.combined`: k the two `interleaved` [B, T, 2 * H_kv, Dh], v None) at positions [B, T]
    through `pages` (global page ids; this device holds pages first_page.. of the run's pools
    [layers, n, ...]) and attends q: [B, T, H, Dh] over them with `kernel`, keys older than
    `window` positions masked (0: none) and the device's heads' `sinks` [H] (or None) in the
    softmax, the kernel's blocks chosen for `device` (device kind, SMs; `platform.tile_device`)
    -> (out [B, T, H, Dh], pool)."""
    shapes = {name: a.shape for name, a in pool.items()}
    table, pool = _one_pool(first_page, pages, pool)
    if kernels.combined(kernel):
        pool = {"kv": write(pool["kv"], widen(k, pool["kv"].shape[-1]), positions, table, seq_axis=1)}
    else:
        pool = {
            name: write(pool[name], widen(new, pool[name].shape[-1]), positions, table, seq_axis=2)
            for name, new in (("k", k), ("v", v))
        }
    out = kernels.attend(kernel, q, pool, positions[:, -1] + 1, table, scale, window, sinks, device)
    return out, {name: a.reshape(shapes[name]) for name, a in pool.items()}


def store_and_attend_latent(
    kernel: str,
    scale: float,
    first_page,
    q,
    q_rope,
    latent,
    k_rope,
    positions,
    pages: LayerPages,
    pool: dict,
    keep=None,
    *,
    device: tuple[str, int] = ("", 0),
):
    """MLA's `store_and_attend`: writes latent [B, T, C] and k_rope [B, T, R] at positions [B, T]
    through `pages` into the run's pools latent and k_rope [layers, n, ps, .] (this device holds
    pages first_page..) and attends q: [B, T, H, C] (the absorbed query) and q_rope: [B, T, H, R]
    over them with `kernel`, positions off `keep` (bool [B, T, P * ps], DSA's selection; None:
    none) masked -> (the latent's weighted sum [B, T, H, C], pool)."""
    shapes = {name: a.shape for name, a in pool.items()}
    table, pool = _one_pool(first_page, pages, pool)
    pool = {
        name: write(pool[name], new, positions, table, seq_axis=1)
        for name, new in (("latent", latent), ("k_rope", k_rope))
    }
    out = kernels.attend_latent(kernel, q, q_rope, pool, positions[:, -1] + 1, table, scale, keep, device)
    return out, {name: a.reshape(shapes[name]) for name, a in pool.items()}


def _one_pool(first_page, pages: LayerPages, pool: dict) -> tuple[jax.Array, dict]:
    """(the tables [B, P] as ids into one pool of the run's layers * n pages, that pool of each
    entry): a bitcast, since the kernels read no layer axis; another device's page, or none: none."""
    layers, n = next(iter(pool.values())).shape[:2]
    table = local(pages.table, first_page, n)
    table = jnp.where(table < n, table + pages.layer * n, layers * n)
    return table, {name: a.reshape(layers * n, *a.shape[2:]) for name, a in pool.items()}


def interleaved(k: jax.Array, v: jax.Array) -> jax.Array:
    """k, v: [B, T, H_kv, Dh] -> [B, T, 2 * H_kv, Dh], k0 v0 k1 v1 ..: a position's row of the "kv" pool."""
    b, t, h, dh = k.shape
    return jnp.stack([k, v], axis=3).reshape(b, t, 2 * h, dh)


def write(pool: jax.Array, new: jax.Array, positions: jax.Array, pages, seq_axis: int) -> jax.Array:
    """pool <- new: [B, T, ...] at positions [B, T] through `pages` (a table [B, P], or
    LayerPages into stacked pools). seq_axis: the page offset's axis in a layer's pool
    (1: [N, ps, R]; 2: [N, H, ps, Dh] with new [B, T, H, Dh])."""
    lead, table = _at(pages)
    ps, n = pool.shape[len(lead) + seq_axis], pool.shape[len(lead)]
    slot = positions // ps  # [B, T]
    # Each position's page as a masked sum over its table's row (a TPU's gather of it was six ops a
    # layer at batch 64); off the table: none (n).
    page = jnp.sum(jnp.where(slot[..., None] == jnp.arange(table.shape[1]), table[:, None, :], 0), axis=-1)
    page = jnp.where(slot < table.shape[1], page, n)  # [B, T]
    index = (*lead, page, *[slice(None)] * (seq_axis - 1), positions % ps)
    # No index is negative (a page off the table is n): a wrap of negatives was three ops a layer on a TPU.
    return pool.at[index].set(new.astype(pool.dtype), mode="drop", wrap_negative_indices=False)


def read(pool: jax.Array, pages, seq_axis: int) -> jax.Array:
    """The pages of a table [B, P] (or LayerPages) as a contiguous cache: [B, P*ps, R] (seq_axis 1)
    or [B, H, P*ps, Dh] (seq_axis 2); pages the table does not name read as zeros."""
    lead, table = _at(pages)
    pages = pool.at[(*lead, table)].get(mode="fill", fill_value=0)  # [B, P, (H,) ps, ...]
    b, p = table.shape
    if seq_axis == 2:
        pages = jnp.moveaxis(pages, 1, 2)  # [B, H, P, ps, Dh]
        return pages.reshape(b, pages.shape[1], p * pages.shape[3], *pages.shape[4:])
    return pages.reshape(b, p * pages.shape[2], *pages.shape[3:])
