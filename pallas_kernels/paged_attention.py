"""GQA attention over a paged KV cache through JAX's own Pallas kernels, by name.

`pallas_tpu`: `jax.experimental.pallas.ops.tpu.ragged_paged_attention` (Mosaic TPU), which
reads prefill chunks and decode steps alike, from one pool holding each position's keys and
values interleaved by head, [pages, page_size, 2 * H_kv, Dh padded to 128 lanes]: the layout
it wants (a TPU array's last axis is padded to 128 lanes in memory anyway).
`pallas_gpu` (`interpret_gpu`: in Pallas' interpreter): `jax/experimental/pallas/ops/gpu/
paged_attention.py` (Triton), decode steps only, from the XLA path's own pools k, v
[pages, H_kv, page_size, Dh padded to a power of two of at least 16]: a kv head's page is
contiguous there, so the pool viewed as [pages * H_kv, page_size, Dh] is the kernel's pool of
one kv head, and each (request, kv head) one of its sequences (no copy of the pool). Triton's
blocks are powers of two, and a dot's every dim at least 16: hence the padded head width (its
zeros add nothing to q.k, nor to the output columns kept); a page of a size no power of two is
read as sub-pages of the largest power of two dividing it (a view too), and the block table
is padded to whole compute blocks (at least 16 positions, at most GPU_BLOCK_BYTES of keys) with
pages past every length.

Both take one device's requests and pages (the placement runs them under shard_map) and a
block table of page ids in [0, pages] (`pages`: none; the kernels read page 0 there, rows that
own no page are padding whose outputs nobody reads). A request's positions in a call are
consecutive, ending at the last it writes.
"""

from __future__ import annotations

import jax.numpy as jnp

LANES = 128  # the TPU kernel's head_dim: its softmax statistics are [.., 128] and broadcast over Dh
# The TPU kernel's blocks when no tuned size applies (its own defaults on TPU v5 and later).
TPU_KV_PAGES_PER_BLOCK, TPU_QUERIES_PER_BLOCK = 128, 32
GPU_SPLITS, GPU_PAGES_PER_BLOCK = 16, 8  # the Triton kernel's defaults: splits of the pages, pages per step
TRITON_DOT = 16  # a Triton dot's least size along each dim: the head width's and a compute block's positions
# The most bytes of keys (and as many of values) a compute block of the Triton kernel holds in
# shared memory: an H100's 228 KB holds both, but not twice that (f32 heads of 256 in blocks of
# 128 positions asked for 280 KB).
GPU_BLOCK_BYTES = 64 << 10

KERNELS = ("pallas_tpu", "pallas_gpu", "interpret_gpu")


def combined(name: str) -> bool:
    """Whether kernel `name` reads one interleaved k/v pool ("kv") rather than the pools k and v."""
    return name == "pallas_tpu"


def prefills(name: str) -> bool:
    """Whether kernel `name` reads a prefill chunk's many positions per request (else decode only)."""
    return name == "pallas_tpu"


def head_dim(name: str, dh: int) -> int:
    """The pool's last axis for heads of `dh` under kernel `name`: the TPU kernel's 128 lanes, the
    Triton kernel's power of two (at least a dot's 16), else dh."""
    if combined(name):
        return -(-dh // LANES) * LANES
    if name in ("pallas_gpu", "interpret_gpu"):
        return max(TRITON_DOT, 1 << (dh - 1).bit_length())
    return dh


def attend(name: str, q, pool: dict, lens, table, scale: float):
    """q: [B, T, H, Dh] queries at each request's last T positions, lens: int32 [B] its positions
    so far (the last query's + 1), table: [B, P] -> [B, T, H, Dh]."""
    if combined(name):
        return _ragged(q, pool["kv"], lens, table, scale)
    return _decode(q, pool["k"], pool["v"], lens, table, scale, interpret=name == "interpret_gpu")


def _ragged(q, kv, lens, table, scale):
    """JAX's ragged paged attention: requests of T queries each, concatenated."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    b, t, h, dh = q.shape
    pages, ps, _, lanes = kv.shape
    p = table.shape[1]
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, lanes - dh))).reshape(b * t, h, lanes)
    lens = jnp.clip(lens, t, p * ps)  # a request past its table (writes dropped) reads its last page
    # Block sizes given: its tuned table looks up the device it runs on, which an export has not.
    out = ragged_paged_attention(
        q,
        kv,
        lens,
        jnp.minimum(table, pages - 1),
        jnp.arange(b + 1, dtype=jnp.int32) * t,
        jnp.full((1,), b, jnp.int32),
        sm_scale=scale,
        num_kv_pages_per_block=min(p, TPU_KV_PAGES_PER_BLOCK),
        num_queries_per_block=min(b * t, TPU_QUERIES_PER_BLOCK),
    )
    return out.reshape(b, t, h, lanes)[..., :dh]


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _decode(q, k, v, lens, table, scale, interpret: bool):
    """JAX's Triton paged attention, one query per request; each (request, kv head) is a
    sequence of its own over the pools [pages, H_kv, ps, W] (W: `head_dim`) viewed as one kv
    head's pool of sub-pages [pages * H_kv * ps / sub, sub, W], `sub` the largest power of two
    dividing ps (at most a compute block's positions)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    b, t, h, dh = q.shape
    if t != 1:
        raise ValueError(f"the GPU paged-attention kernel reads one query per request, got {t}")
    pages, hkv, ps, width = k.shape
    p = table.shape[1]
    most = max(TRITON_DOT, _pow2_floor(GPU_BLOCK_BYTES // (width * k.dtype.itemsize)))  # positions a block may hold
    sub = min(ps & -ps, most)
    per = ps // sub  # sub-pages per page
    # Splits of a sequence's n sub-pages and blocks of `block` sub-pages (a power of two, at least a
    # dot's 16 positions and at most `most`): the table padded to whole blocks of every split.
    n, least = p * per, max(1, TRITON_DOT // sub)
    splits = min(GPU_SPLITS, -(-n // least))
    block = max(least, min(GPU_PAGES_PER_BLOCK, most // sub, _pow2_floor(-(-n // splits))))
    padded = splits * block * -(-n // (splits * block))
    i = jnp.arange(padded)
    page = jnp.minimum(table, pages - 1)[
        :, jnp.minimum(i // per, p - 1)
    ]  # [B, padded]; past the table: read no position
    rows = (page[:, None, :] * hkv + jnp.arange(hkv, dtype=table.dtype)[None, :, None]) * per + i % per
    one_head = lambda pool: pool.reshape(1, pages * hkv * per, sub, width)
    q = jnp.pad((q * scale).astype(q.dtype).reshape(b * hkv, h // hkv, dh), ((0, 0), (0, 0), (0, width - dh)))
    out = paged_attention(
        q,
        one_head(k),
        one_head(v),
        rows.reshape(b * hkv, padded),
        jnp.repeat(jnp.clip(lens, 1, p * ps), hkv),
        k_splits=splits,
        pages_per_compute_block=block,
        interpret=interpret,
    )
    return out.reshape(b, 1, h, width)[..., :dh]
