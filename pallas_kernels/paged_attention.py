"""GQA attention over a paged KV cache through JAX's own Pallas kernels, by name.

`pallas_tpu`: `jax.experimental.pallas.ops.tpu.ragged_paged_attention` (Mosaic TPU), which
reads prefill chunks and decode steps alike, from one pool holding each position's keys and
values interleaved by head, [pages, page_size, 2 * H_kv, Dh padded to 128 lanes]: the layout
it wants (a TPU array's last axis is padded to 128 lanes in memory anyway).
`pallas_gpu` (`interpret_gpu`: in Pallas' interpreter): `jax/experimental/pallas/ops/gpu/
paged_attention.py` (Triton), decode steps only, from the XLA path's own pools k, v
[pages, H_kv, page_size, Dh]: a kv head's page is contiguous there, so the pool viewed as
[pages * H_kv, page_size, Dh] is the kernel's pool of one kv head, and each (request, kv head)
one of its sequences (no copy of the pool).

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

KERNELS = ("pallas_tpu", "pallas_gpu", "interpret_gpu")


def combined(name: str) -> bool:
    """Whether kernel `name` reads one interleaved k/v pool ("kv") rather than the pools k and v."""
    return name == "pallas_tpu"


def prefills(name: str) -> bool:
    """Whether kernel `name` reads a prefill chunk's many positions per request (else decode only)."""
    return name == "pallas_tpu"


def head_dim(name: str, dh: int) -> int:
    """The pool's last axis for heads of `dh` under kernel `name`."""
    return -(-dh // LANES) * LANES if combined(name) else dh


def unavailable(name: str, platform: str) -> str | None:
    """Why kernel `name` cannot run on `platform`, or None if it can."""
    if name == "pallas_tpu" and platform != "tpu":
        return f"needs a TPU; this machine's backend is {platform} (plan --target v5e compiles for one)"
    if name == "pallas_gpu" and platform not in ("gpu", "cuda"):
        return f"needs an NVIDIA GPU; this machine's backend is {platform} (interpret_gpu runs it interpreted)"
    return None


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
    out = ragged_paged_attention(q, kv, lens, jnp.minimum(table, pages - 1), jnp.arange(b + 1, dtype=jnp.int32) * t,
                                 jnp.full((1,), b, jnp.int32), sm_scale=scale,
                                 num_kv_pages_per_block=min(p, TPU_KV_PAGES_PER_BLOCK),
                                 num_queries_per_block=min(b * t, TPU_QUERIES_PER_BLOCK))
    return out.reshape(b, t, h, lanes)[..., :dh]


def _divisor(n: int, most: int) -> int:
    """The largest divisor of n of at most `most`."""
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


def _decode(q, k, v, lens, table, scale, interpret: bool):
    """JAX's Triton paged attention, one query per request; each (request, kv head) is a
    sequence of its own over the pools viewed as one kv head's [pages * H_kv, page_size, Dh]."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    b, t, h, dh = q.shape
    if t != 1:
        raise ValueError(f"the GPU paged-attention kernel reads one query per request, got {t}")
    pages, hkv, ps, _ = k.shape
    p = table.shape[1]
    rows = (jnp.minimum(table, pages - 1) * hkv)[:, None, :] + jnp.arange(hkv, dtype=table.dtype)[None, :, None]
    one_head = lambda pool: pool.reshape(1, pages * hkv, ps, dh)
    splits = _divisor(p, GPU_SPLITS)
    out = paged_attention((q * scale).astype(q.dtype).reshape(b * hkv, h // hkv, dh), one_head(k), one_head(v),
                          rows.reshape(b * hkv, p), jnp.repeat(jnp.clip(lens, 1, p * ps), hkv),
                          k_splits=splits, pages_per_compute_block=_divisor(p // splits, GPU_PAGES_PER_BLOCK),
                          interpret=interpret)
    return out.reshape(b, 1, h, dh)

