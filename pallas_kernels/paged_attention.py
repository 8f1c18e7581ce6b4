"""GQA (and, on the GPU, MLA) attention over a paged KV cache through Pallas kernels, by name.

`pallas_tpu`: `jax.experimental.pallas.ops.tpu.ragged_paged_attention` (Mosaic TPU), which
reads prefill chunks and decode steps alike, from one pool holding each position's keys and
values interleaved by head, [pages, page_size, 2 * H_kv, Dh padded to 128 lanes]: the layout
it wants (a TPU array's last axis is padded to 128 lanes in memory anyway). Its softmax takes
no attention sinks and masks no sliding window (`reads_windows`).
`mosaic_gpu` (`interpret_mosaic_gpu`: in JAX's Mosaic GPU interpreter): our Mosaic GPU flash-decoding
kernel (`paged_attention_mgpu`; compiled for an H100 here, never run on a GPU by these tests),
decode steps only, with sliding windows and sinks, from the XLA path's own pools k, v
[pages, H_kv, page_size, W], W: Dh padded to whole 32-byte granules (`pool_width`: zeros after
Dh, which add nothing to q.k and are cut from the output). Its compute block and splits are
chosen here (`gpu_blocks`), from the device's SMs and the table's rule (`tiles.lookup`), as are the
TPU kernel's blocks.
It also reads MLA's pools latent [pages, ps, C] and k_rope [pages, ps, R] (`attend_latent`: the
absorbed attention of a decode step, DSA's selection masked; "latent" in its record's `reads`),
its heads a CTA and blocks chosen here too (`latent_blocks`).

Both take one device's requests and pages (the placement runs them under shard_map) and a
block table of page ids in [0, pages] (`pages`: none; the TPU kernel reads page 0 there, the
GPU one masks it; rows that own no page are padding whose outputs nobody reads). A request's
positions in a call are consecutive, ending at the last it writes.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import catalog, tiles
from pallas_kernels.paged_layout_mgpu import (
    GRANULE,
    ROWS,
    SMEM_BYTES,
    latent_smem_bytes,
    page_rows,
    pool_width,
    smem_bytes,
)

LANES = 128  # the TPU kernel's head_dim: its softmax statistics are [.., 128] and broadcast over Dh

KERNELS = catalog.names(catalog.ATTENTION)
GPU_KERNELS = tuple(k for k in KERNELS if catalog.attention(k).backend == "mosaic_gpu")  # ours, compiled or interpreted


def combined(name: str) -> bool:
    """Whether kernel `name` reads one interleaved k/v pool ("kv") rather than the pools k and v."""
    return _reads(name, "kv")


def prefills(name: str) -> bool:
    """Whether kernel `name` reads a prefill chunk's many positions per request (else decode only)."""
    return _reads(name, "prefill")


def reads_latent(name: str) -> bool:
    """Whether kernel `name` reads MLA's latent pools (the GPU kernel's `latent_attention`)."""
    return _reads(name, "latent")


def latent_refusal(c: int, r: int, dtype) -> str | None:
    """Why the GPU kernel cannot read MLA's pools of a latent of c and a rope key of r in `dtype`
    (None: it can): their rows are TMA copies of whole 32-byte granules, as the model's pools lie."""
    if pool_width(c, dtype) == c and pool_width(r, dtype) == r:
        return None
    return f"its latent ({c}) and rope key ({r}) must be whole {GRANULE}-byte rows in {jnp.dtype(dtype).name}"


def reads_windows(name: str) -> bool:
    """Whether kernel `name` takes sliding windows and attention sinks (the GPU kernel's do)."""
    return _reads(name, "windows")


def _reads(name: str, what: str) -> bool:
    """Whether `name` (a kernel, or "xla": the gather of `moejax.model.paged`) reads `what` (its record's `reads`)."""
    return name != "xla" and what in catalog.attention(name).reads


def head_dim(name: str, dh: int, dtype) -> int:
    """The pool's last axis for heads of `dh` in `dtype` under kernel `name`: the TPU kernel's 128
    lanes, the GPU kernel's whole 32-byte granules (`pool_width`), else dh."""
    if combined(name):
        return -(-dh // LANES) * LANES
    if name in GPU_KERNELS:
        return pool_width(dh, dtype)
    return dh


def attend(name: str, q, pool: dict, lens, table, scale: float, window: int = 0, sinks=None, device=("", 0)):
    """q: [B, T, H, Dh] queries at each request's last T positions, lens: int32 [B] its positions
    so far (the last query's + 1), table: [B, P], window: the sliding window (0: none), sinks: [H]
    logits or None (both GPU only: `reads_windows`), device: (device kind, SMs) the blocks are chosen
    for (("", 0): unknown) -> [B, T, H, Dh]."""
    if combined(name):
        return _ragged(q, pool["kv"], lens, table, scale, device)
    interpret = catalog.attention(name).interpreted
    return _decode(q, pool["k"], pool["v"], lens, table, scale, window, sinks, interpret, device)


def _ragged(q, kv, lens, table, scale, device):
    """JAX's ragged paged attention: requests of T queries each, concatenated."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    b, t, h, dh = q.shape
    pages, ps, _, lanes = kv.shape
    p = table.shape[1]
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, lanes - dh))).reshape(b * t, h, lanes)
    lens = jnp.clip(lens, t, p * ps)  # a request past its table (writes dropped) reads its last page
    # Block sizes given: its tuned table looks up the device it runs on, which an export has not.
    blocks = tiles.lookup("ragged_paged_attention", device)
    out = ragged_paged_attention(
        q,
        kv,
        lens,
        jnp.minimum(table, pages - 1),
        jnp.arange(b + 1, dtype=jnp.int32) * t,
        jnp.full((1,), b, jnp.int32),
        sm_scale=scale,
        num_kv_pages_per_block=min(p, blocks["kv_pages_per_block"]),
        num_queries_per_block=min(b * t, blocks["queries_per_block"]),
    )
    return out.reshape(b, t, h, lanes)[..., :dh]


def gpu_blocks(b: int, hkv: int, groups: int, w: int, page_size: int, p: int, dtype, device=("", 0)) -> tuple[int, int]:
    """(pages_per_block, splits) of the GPU kernel for b requests of hkv kv heads (`groups` query
    heads each) over tables of p pages, pools `w` wide in `dtype`, on `device` (device kind, SMs).
    A compute block holds as many pages as fill the register tile's ROWS positions (its rows are
    padded to them anyway; at least one page, at most the table's); the splits are as many as make
    splits * b * hkv CTAs cover the device's SMs about the table's `waves` times (SMs unknown: no
    bound), at most the table's blocks (a split past them reads nothing) and its `max_splits`.
    Where their SMEM is over SMEM_BYTES, fewer splits (each holds a partial), then fewer pages;
    a shape that fits in none is the kernel's to refuse."""
    return _blocks(
        b * hkv, page_size, p, lambda pages, splits: smem_bytes(groups, w, page_size, pages, splits, dtype), device
    )


def latent_blocks(
    b: int, h: int, c: int, r: int, page_size: int, p: int, dtype, device=("", 0)
) -> tuple[int, int, int]:
    """(heads, pages_per_block, splits) of the GPU kernel's MLA attention (`latent_attention`) for b
    requests of h query heads over a latent of c and a rope key of r: the most heads a CTA whose
    accumulators and partials SMEM holds beside a block's latent (all h where it can: each reads
    the latent once for them), then `gpu_blocks`' rule for its CTAs."""
    smem = lambda heads, pages=1, splits=1: latent_smem_bytes(heads, c, r, page_size, pages, splits, dtype)
    heads = max([n for n in range(1, h + 1) if h % n == 0 and smem(n) <= SMEM_BYTES] or [1])
    return heads, *_blocks(b * (h // heads), page_size, p, lambda pages, splits: smem(heads, pages, splits), device)


def _blocks(ctas: int, page_size: int, p: int, smem, device) -> tuple[int, int]:
    """(pages_per_block, splits) for `ctas` CTAs a split over tables of p pages whose SMEM is
    smem(pages, splits) (`gpu_blocks`' rule)."""
    rule = tiles.lookup("paged_attention_mgpu", device)
    sms = device[1]
    pages = min(p, max(1, ROWS // page_rows(page_size)))
    covering = -(-rule["waves"] * sms // ctas) if sms else rule["max_splits"]
    splits = max(1, min(covering, -(-p // pages), rule["max_splits"]))
    fits = lambda: smem(pages, splits) <= SMEM_BYTES
    while not fits() and splits > 1:
        splits -= 1
    while not fits() and pages > 1:
        pages -= 1
    return pages, splits


def _decode(q, k, v, lens, table, scale, window, sinks, interpret: bool, device):
    """The Mosaic GPU kernel, one query per request, over the pools k, v [pages, H_kv, ps, W]."""
    from pallas_kernels import paged_attention_mgpu as mgpu  # Mosaic GPU's modules load only where it runs

    b, t, h, dh = q.shape
    if t != 1:
        raise ValueError(f"the GPU paged-attention kernel reads one query per request, got {t}")
    _, hkv, ps, width = k.shape
    pages_per_block, splits = gpu_blocks(b, hkv, h // hkv, width, ps, table.shape[1], k.dtype, device)
    out = mgpu.paged_attention(
        q[:, 0].astype(k.dtype),
        k,
        v,
        table,
        lens,
        scale=scale,
        window=window,
        sinks=sinks,
        pages_per_block=pages_per_block,
        splits=splits,
        interpret=interpret,
    )
    return out.astype(q.dtype)[:, None]


def attend_latent(name: str, q, q_rope, pool: dict, lens, table, scale: float, keep=None, device=("", 0)):
    """MLA's absorbed decode attention through the GPU kernel `name`: q: [B, 1, H, C] (the query in
    the latent space), q_rope: [B, 1, H, R] over the pools latent [pages, ps, C] and k_rope
    [pages, ps, R], lens: int32 [B], table: [B, P], keep: bool [B, 1, P * ps] (DSA's selection) or
    None -> the latent's weighted sum [B, 1, H, C]."""
    from pallas_kernels import paged_attention_mgpu as mgpu  # Mosaic GPU's modules load only where it runs

    b, t, h, c = q.shape
    if t != 1:
        raise ValueError(f"the GPU paged-attention kernel reads one query per request, got {t}")
    latent, k_rope = pool["latent"], pool["k_rope"]
    _, ps, r = k_rope.shape
    heads, pages_per_block, splits = latent_blocks(b, h, c, r, ps, table.shape[1], latent.dtype, device)
    out = mgpu.latent_attention(
        q[:, 0].astype(latent.dtype),
        q_rope[:, 0].astype(latent.dtype),
        latent,
        k_rope,
        table,
        lens,
        None if keep is None else keep[:, 0],
        scale=scale,
        heads=heads,
        pages_per_block=pages_per_block,
        splits=splits,
        interpret=catalog.attention(name).interpreted,
    )
    return out.astype(q.dtype)[:, None]
