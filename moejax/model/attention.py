"""Attention over a preallocated KV cache: grouped-query (GQA) and multi-head latent (MLA).

Both take `x: [B, T, D]` with `positions: [B, T]`, write the new keys at those positions
(writes past the cache end are dropped; the engine ends such requests) and attend causally
to every cached position <= the query's own. The cache is contiguous ([B, ..., S, ...] per
entry) or, given a block table `pages: [B, P]`, a pool of pages (`paged.py`) whose request's
pages are read back as a contiguous view of P * page_size positions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from moejax.base.platform import tile_device
from moejax.config import ModelConfig
from moejax.model import dsa, paged, projections
from pallas_kernels import paged_attention as kernels

KV_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")  # GQA cache: [B, H_kv, S, Dh]
# A prefill chunk longer than QUERY_BLOCK attends a block of queries at a time over blocks of
# KEY_BLOCK keys (`_attend`).
QUERY_BLOCK = 128
KEY_BLOCK = 128


def cache_specs(c: ModelConfig, batch: int, max_len: int, layer: int | None = None) -> dict:
    """Cache entries of `layer` (None: of any layer): name -> (shape, logical axes). MLA caches
    the compressed latent; a DSA layer with its own indexer also caches the indexer's keys."""
    if c.is_mla:
        specs = {
            "latent": ((batch, max_len, c.kv_lora_rank), ("batch", "cache_seq", None)),
            "k_rope": ((batch, max_len, c.qk_rope_head_dim), ("batch", "cache_seq", None)),
        }
        if c.is_dsa and (layer is None or c.has_indexer(layer)):
            specs["index_k"] = ((batch, max_len, c.index_head_dim), ("batch", "cache_seq", None))
        return specs
    # Heads before positions: attention's dots then read the cache as it lies (XLA:CPU would
    # otherwise transpose the whole cache every step, which cost more than the dots).
    kv = ((batch, c.num_kv_heads, max_len, c.head_dim), KV_AXES)
    return {"k": kv, "v": kv}


def _write(cache: jax.Array, new: jax.Array, positions: jax.Array, seq_axis: int = 1) -> jax.Array:
    """cache <- new: [B, T, ...] at positions: [B, T] along the cache's seq_axis.
    cache: [B, S, ...] (seq_axis 1) or [B, H, S, Dh] (seq_axis 2, new: [B, T, H, Dh])."""
    b = jnp.arange(cache.shape[0])[:, None]
    index = (b, *[slice(None)] * (seq_axis - 1), positions)
    return cache.at[index].set(new.astype(cache.dtype), mode="drop")


def _store(cache: dict, name: str, new: jax.Array, positions: jax.Array, pages, placement, seq_axis: int = 1):
    """Writes `new` into entry `name` -> (cache, the entry as a contiguous [B, ..., S, ...] view:
    the whole cache, or the pages of the block table `pages`, each device on its own pages)."""
    if pages is None:
        written = _write(cache[name], new, positions, seq_axis)
        return {**cache, name: written}, written
    pool, view = placement.store_pages(cache[name], new, positions, pages, seq_axis)
    return {**cache, name: pool}, view


def _causal_mask(positions: jax.Array, max_len: int, window=0, first=0) -> jax.Array:
    """[B, T, max_len]: key position s (first, first + 1, ...) is visible to the query at position
    p when s <= p (and, with a sliding `window` > 0, s > p - window). `window` may be traced: a
    layer scan's per-layer input; `first` too."""
    s, p = first + jnp.arange(max_len)[None, None, :], positions[:, :, None]
    return (s <= p) & ((window == 0) | (s > p - window))


def _slice(x: jax.Array, start, size: int, axis: int) -> jax.Array:
    """x[start : start + size] along axis (x itself when that is all of it)."""
    return x if size == x.shape[axis] else lax.dynamic_slice_in_dim(x, start, size, axis)


def _attend(
    scores, weigh, mask, positions: jax.Array, s: int, out_shape: tuple, t_axis: int, window=0, sinks=None
) -> jax.Array:
    """softmax(scores) @ values of the T = out_shape[t_axis] queries at `positions` [B, T] over s
    cached keys, from closures over one attention's layout: scores(q0, tq, k0, tk) -> float
    [..., tq, tk] of queries q0.. against keys k0..; mask(q0, tq, k0, tk) -> bool, broadcast
    against them; weigh(w [..., tq, tk], k0, tk) -> [..., tq, Dv] the weights times those keys'
    values. `sinks` (broadcast against [..., tq, 1]) are logits that join the softmax's sum but
    attend to nothing (gpt-oss's attention sinks).

    Decode (and a short chunk) is one block. A prefill chunk of T > QUERY_BLOCK goes a block of
    queries at a time, each over the blocks of KEY_BLOCK keys from the first its window sees to
    the last its latest position reaches, with flash attention's running softmax: the scores
    above the causal diagonal are never computed, and the loops keep the program the size of one
    block (XLA:CPU sets up each of a program's fused dots on its first run)."""
    t = out_shape[t_axis]

    def step(q0, tq, k0, tk, carry):  # carry: running max and sum [..., tq, 1], weighted values [..., tq, Dv]
        top, total, acc = carry
        sc = jnp.where(mask(q0, tq, k0, tk), scores(q0, tq, k0, tk).astype(jnp.float32), -jnp.inf)
        new_top = jnp.maximum(top, sc.max(-1, keepdims=True))
        base = jnp.where(new_top == -jnp.inf, 0.0, new_top)  # rows that have seen no key yet
        w, kept = jnp.exp(sc - base), jnp.exp(top - base)
        return new_top, total * kept + w.sum(-1, keepdims=True), acc * kept + weigh(w, k0, tk)

    def block(q0, tq, k_blocks):
        shape = out_shape[:t_axis] + (tq,) + out_shape[t_axis + 1 :]
        carry = (jnp.full(shape[:-1] + (1,), -jnp.inf), jnp.zeros(shape[:-1] + (1,)), jnp.zeros(shape))
        if k_blocks is None:
            top, total, acc = step(q0, tq, 0, s, carry)
        else:
            top, total, acc = lax.fori_loop(*k_blocks, lambda j, c: step(q0, tq, j * KEY_BLOCK, KEY_BLOCK, c), carry)
        if sinks is not None:
            new_top = jnp.maximum(top, sinks)
            kept = jnp.exp(top - new_top)
            total, acc = total * kept + jnp.exp(sinks - new_top), acc * kept
        return acc / total

    if t <= QUERY_BLOCK or t % QUERY_BLOCK or s % KEY_BLOCK:
        return block(0, t, None)

    def query_block(i, out):
        q0 = i * QUERY_BLOCK
        p = lax.dynamic_slice_in_dim(positions, q0, QUERY_BLOCK, 1)
        first = jnp.where(window > 0, jnp.maximum(p.min() - window + 1, 0) // KEY_BLOCK, 0)
        end = jnp.minimum(p.max() // KEY_BLOCK + 1, s // KEY_BLOCK)
        return lax.dynamic_update_slice_in_dim(out, block(q0, QUERY_BLOCK, (first, end)).astype(out.dtype), q0, t_axis)

    return lax.fori_loop(0, t // QUERY_BLOCK, query_block, jnp.zeros(out_shape, jnp.float32))


def gqa(
    p: dict,
    x: jax.Array,
    norm: jax.Array,
    positions: jax.Array,
    cos_sin,
    cache: dict,
    c: ModelConfig,
    placement,
    window=0,
    pages=None,
):
    """x: [B, T, D] the residual stream, `norm` the attention norm's weight -> (x + attention, cache)."""
    reads = _kernel_reads(placement.attention_kernel, x, pages)
    interleave = reads and kernels.combined(placement.attention_kernel)  # k|v as its pool's rows, v None
    q, k, v = projections.qkv(placement.decode, p, x, norm, cos_sin, c, interleave)
    if reads:
        out, cache = _gqa_kernel(p, q, k, v, positions, cache, c, placement, pages)
    else:
        out, cache = _gqa_xla(p, q, k, v, positions, cache, c, placement, window, pages)
    return projections.out(placement.decode, p, out, x, c), cache


def _kernel_reads(kernel: str, x, pages) -> bool:
    """Whether the paged-attention `kernel` reads this call's pages: a decode step (or any call, for
    a kernel that prefills), and with page groups a layer whose group is known as it is traced (a
    scan over mixed layers picks it at run time: the XLA path's `lax.cond`)."""
    if pages is None or kernel == "xla" or not (x.shape[1] == 1 or kernels.prefills(kernel)):
        return False
    return not isinstance(pages, paged.GroupPages) or isinstance(pages.window, bool)


def _gqa_kernel(p: dict, q, k, v, positions, cache: dict, c: ModelConfig, placement, pages):
    """`_gqa_xla` through the placement's paged-attention kernel, which reads the pages itself, per
    device (the placement's shard_map): over the layer's own group's pool entries and tables (with
    page groups: `GroupPages`), a window layer's window masked, and the heads' sinks (k, v: as
    `paged.store_and_attend` takes them)."""
    prefix, window = "", 0
    if isinstance(pages, paged.GroupPages):
        prefix, pages = pages.group(pages.window)
        window = c.sliding_window if prefix else 0
    pool = {paged.base(name): a for name, a in cache.items() if paged.in_window(name) == bool(prefix)}
    sinks = p["sinks"] if c.attention_sinks else None
    attend = functools.partial(
        paged.store_and_attend,
        placement.attention_kernel,
        c.softmax_scale,
        window,
        device=tile_device(placement.first_device),
    )
    out, pool = placement.on_pages(attend, q, k, v, positions, pages, pool, sinks)
    return out, {**cache, **{prefix + name: a for name, a in pool.items()}}


def _gqa_xla(p: dict, q, k, v, positions, cache: dict, c: ModelConfig, placement, window, pages):
    """q: [B, T, H, Dh], k, v: [B, T, H_kv, Dh] -> (out [B, T, H, Dh], cache): masked attention
    over the contiguous cache, or the view of the request's pages (with page groups, `GroupPages`:
    its own group's pool and tables; in a scan over mixed layers `lax.cond` picks the group, so a
    layer reads one group's pool, not both)."""
    if isinstance(pages, paged.GroupPages):

        def in_group(window_group: bool, cache: dict):
            prefix, layer_pages = pages.group(window_group)
            return _gqa_xla_in(p, q, k, v, positions, cache, c, placement, window, layer_pages, prefix)

        if isinstance(pages.window, bool):
            return in_group(pages.window, cache)
        return jax.lax.cond(pages.window, functools.partial(in_group, True), functools.partial(in_group, False), cache)
    return _gqa_xla_in(p, q, k, v, positions, cache, c, placement, window, pages)


def _gqa_xla_in(p: dict, q, k, v, positions, cache: dict, c: ModelConfig, placement, window, pages, prefix: str = ""):
    """`_gqa_xla` over the cache entries prefix + "k" and prefix + "v" (a page group's)."""
    b, t, h, dh = q.shape
    width = cache[prefix + "k"].shape[-1]  # a pool's heads may be wider, as a kernel reads them (`paged.widen`)
    cache, keys = _store(cache, prefix + "k", paged.widen(k, width), positions, pages, placement, seq_axis=2)
    cache, values = _store(cache, prefix + "v", paged.widen(v, width), positions, pages, placement, seq_axis=2)
    keys = placement.constrain(keys[..., :dh], KV_AXES)  # [B, H_kv, S, Dh]
    values = placement.constrain(values[..., :dh], KV_AXES)
    groups = h // c.num_kv_heads
    # q as [B, H_kv, G, T, Dh]: the scores [B, H_kv, G, T, S] then come out of their dot as laid
    # out, where from [B, T, H_kv, G, Dh] XLA:CPU transposes every score (T rows x S) once more.
    q = q.reshape(b, t, c.num_kv_heads, groups, dh).transpose(0, 2, 3, 1, 4)
    sinks = p["sinks"].reshape(c.num_kv_heads, groups, 1, 1) if c.attention_sinks else None
    out = _gqa_attend(q, keys, values, positions, window, sinks, scale=c.softmax_scale)  # [B, H_kv, G, T, Dh]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh), cache


@functools.partial(jax.jit, static_argnames="scale")
def _gqa_attend(q, keys, values, positions, window, sinks, scale: float):
    """q: [B, H_kv, G, T, Dh] over keys, values [B, H_kv, S, Dh] -> [B, H_kv, G, T, Dh]. Its own
    jit: the layers of a program trace and lower it once for all (unrolled, each layer's attention
    loops would be traced again)."""
    return _attend(
        lambda q0, tq, k0, tk: jnp.einsum("bkgtd,bksd->bkgts", _slice(q, q0, tq, 3), _slice(keys, k0, tk, 2)) * scale,
        lambda w, k0, tk: jnp.einsum("bkgts,bksd->bkgtd", w.astype(values.dtype), _slice(values, k0, tk, 2)),
        lambda q0, tq, k0, tk: _causal_mask(_slice(positions, q0, tq, 1), tk, window, k0)[:, None, None],
        positions,
        keys.shape[2],
        q.shape,
        3,
        window,
        sinks,
    ).astype(values.dtype)


def mla(
    p: dict,
    residual: jax.Array,
    norm: jax.Array,
    positions: jax.Array,
    cos_sin,
    cache: dict,
    c: ModelConfig,
    placement,
    selected=None,
    pages=None,
):
    """DeepSeek's MLA with the key/value up-projections absorbed into the query and output.

    DSA (GLM-5): a layer with an indexer selects the key positions each query sees; a layer
    without one is handed the previous layer's `selected` (bool [B, T, S]). Returns
    (residual + out, cache, selected)."""
    q_nope, q_rope, latent, k_rope, index = projections.latent(placement.decode, p, residual, norm, cos_sin, c)
    if index is not None:
        index_k, index_q, head_weights = index
        cache, keys = _store(cache, "index_k", index_k, positions, pages, placement)
        keys = placement.constrain(keys, ("batch", "cache_seq", None))
        selected = dsa.select(index_q, head_weights, keys, _causal_mask(positions, keys.shape[1]), c)
    q_abs = jnp.einsum("bthk,rhk->bhtr", q_nope, p["w_uk"])  # query in the latent space
    if _kernel_reads(placement.attention_kernel, q_nope, pages):
        out_lat, cache = _mla_kernel(q_abs, q_rope, latent, k_rope, positions, cache, c, placement, selected, pages)
    else:
        out_lat, cache = _mla_xla(q_abs, q_rope, latent, k_rope, positions, cache, c, placement, selected, pages)
    out = jnp.einsum("bhtr,rhv->bthv", out_lat, p["w_uv"])
    return projections.out(placement.decode, p, out, residual, c), cache, selected


def _mla_kernel(q_abs, q_rope, latent, k_rope, positions, cache: dict, c: ModelConfig, placement, selected, pages):
    """`_mla_xla` through the placement's paged-attention kernel, which writes and reads the pools
    latent and k_rope itself, per device (the placement's shard_map)."""
    pool = {name: cache[name] for name in ("latent", "k_rope")}
    attend = functools.partial(
        paged.store_and_attend_latent,
        placement.attention_kernel,
        c.softmax_scale,
        device=tile_device(placement.first_device),
    )
    q = q_abs.transpose(0, 2, 1, 3)  # [B, T, H, C]: T = 1, a relabelling
    out, pool = placement.on_latent(attend, q, q_rope, latent, k_rope, positions, pages, pool, selected)
    return out.transpose(0, 2, 1, 3), {**cache, **pool}


def _mla_xla(q_abs, q_rope, latent, k_rope, positions, cache: dict, c: ModelConfig, placement, selected, pages):
    """q_abs: [B, H, T, C] (the query in the latent space), q_rope: [B, T, H, R], the new latent
    [B, T, C] and rope keys [B, T, R] -> (the latent's weighted sum [B, H, T, C], cache): masked
    attention over the contiguous cache, or the view of the request's pages, positions off
    `selected` (DSA's, bool [B, T, S]; None: none) masked."""
    cache, lat = _store(cache, "latent", latent, positions, pages, placement)
    cache, kr = _store(cache, "k_rope", k_rope, positions, pages, placement)
    lat = placement.constrain(lat, ("batch", "cache_seq", None))
    kr = placement.constrain(kr, ("batch", "cache_seq", None))

    def mask(q0, tq, k0, tk):  # [B, 1, tq, tk]
        visible = _causal_mask(_slice(positions, q0, tq, 1), tk, 0, k0)
        if selected is not None:
            visible = visible & _slice(_slice(selected, q0, tq, 1), k0, tk, 2)
        return visible[:, None]

    # Queries as [B, H, T, .]: the scores [B, H, T, S] come out of their dots as laid out (as GQA's).
    q_rope = q_rope.transpose(0, 2, 1, 3)
    out_lat = _attend(
        lambda q0, tq, k0, tk: (
            (
                jnp.einsum("bhtr,bsr->bhts", _slice(q_abs, q0, tq, 2), _slice(lat, k0, tk, 1))
                + jnp.einsum("bhtk,bsk->bhts", _slice(q_rope, q0, tq, 2), _slice(kr, k0, tk, 1))
            )
            * c.softmax_scale
        ),
        lambda w, k0, tk: jnp.einsum("bhts,bsr->bhtr", w.astype(lat.dtype), _slice(lat, k0, tk, 1)),
        mask,
        positions,
        lat.shape[1],
        q_abs.shape,
        2,
    ).astype(lat.dtype)  # [B, H, T, C]
    return out_lat, cache


def attention(p, x, norm, positions, cos_sin, cache, c: ModelConfig, placement, selected=None, window=0, pages=None):
    """x: [B, T, D] the residual stream, `norm` the attention norm's weight -> (x + attention of the
    normed x [B, T, D], cache, selected: the DSA selection a following layer may reuse, else None).
    `window`: a sliding-window layer's window (0: full attention; GQA only); `pages`: the block
    table [B, P] of a paged cache (None: a contiguous one)."""
    if c.is_mla:
        return mla(p, x, norm, positions, cos_sin, cache, c, placement, selected, pages)
    return (*gqa(p, x, norm, positions, cos_sin, cache, c, placement, window, pages), None)
