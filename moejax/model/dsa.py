"""DeepSeek Sparse Attention's indexer (GLM-5): which cached key positions each query attends to.

A light scorer beside MLA: its own query heads (from MLA's query latent) and one key head per
position (cached, like the latent), scores relu(q . k) summed over heads with per-row head
weights, and keeps each query's top `index_topk` visible positions. MLA then attends only to
those (`attention.mla`). Layers without an indexer reuse the previous layer's selection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.config import ModelConfig
from moejax.model.layers import apply_rope

LAYER_NORM_EPS = 1e-6  # transformers' indexer k_norm (nn.LayerNorm default)


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """torch LayerNorm (mean and variance over the last axis) computed in float32."""
    xf = x.astype(jnp.float32)
    xf = xf - xf.mean(-1, keepdims=True)
    xf = xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + eps)
    return (xf * w + b).astype(x.dtype)


def index_keys(p: dict, projected: jax.Array, cos_sin) -> jax.Array:
    """projected: [B, T, Dk] the normed rows times `wk` -> indexer keys [B, T, Dk]; rope (interleaved)
    on the first rope dims only."""
    k = layer_norm(projected, p["k_norm"], p["k_norm_bias"], LAYER_NORM_EPS)
    return apply_rope(k[:, :, None], *cos_sin, interleave=True)[:, :, 0]


def index_queries(p: dict, x: jax.Array, q_lat: jax.Array, cos_sin) -> tuple[jax.Array, jax.Array]:
    """x: [B, T, D] the normed rows, q_lat: [B, T, R] (MLA's normed query latent) -> (the indexer's
    queries [B, T, H, Dk], rope (interleaved) on each head's first rope dims; its per-row head
    weights float32 [B, T, H], unscaled)."""
    q = apply_rope(jnp.einsum("btr,rhk->bthk", q_lat, p["wq"]), *cos_sin, interleave=True)
    return q, x.astype(jnp.float32) @ p["head_weights"]


def select(q: jax.Array, head_weights: jax.Array, keys: jax.Array, visible: jax.Array, c: ModelConfig) -> jax.Array:
    """q: [B, T, H, Dk], head_weights: float32 [B, T, H] (`index_queries`), keys: [B, S, Dk] (cache,
    this step's keys written), visible: bool [B, T, S] (causal) -> selected: bool [B, T, S].

    Fewer than `index_topk` visible positions: every one is selected (top_k ranks the masked
    ones, at -inf, last; they stay invisible through `visible`). A cache of at most `index_topk`
    positions selects them all: no scores to rank, and no top-k of every position (which XLA ran
    after gathering every device's scores to every device under DP attention)."""
    if c.index_topk >= visible.shape[-1]:
        return jnp.ones(visible.shape, bool)
    dk, heads = q.shape[-1], q.shape[-2]
    scores = jax.nn.relu(jnp.einsum("bthk,bsk->bths", q.astype(jnp.float32), keys.astype(jnp.float32)) * dk**-0.5)
    head_weights = head_weights * heads**-0.5
    index = jnp.where(visible, jnp.einsum("bth,bths->bts", head_weights, scores), -jnp.inf)
    b, t, s = index.shape
    _, top = jax.lax.top_k(index, min(c.index_topk, s))  # [B, T, k]
    # A scatter per request (vmap: the batch a scatter's batching dim), which a mesh splits as the
    # requests are; indices over the batch too would gather every device's picks to every device.
    mark = lambda top_b: jnp.zeros((t, s), bool).at[jnp.arange(t)[:, None], top_b].set(True)  # noqa: E731
    return jax.vmap(mark)(top)
