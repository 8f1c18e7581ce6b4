"""The router: one score per expert, then each row's top-k picks and their weights.

Scores are computed in float32 with float32 router weights, as transformers keeps them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.config import ModelConfig


def route(p: dict, x: jax.Array, c: ModelConfig, forced: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x: [T, D] -> (topk_ids: int32 [T, k], topk_weights: float32 [T, k]).

    `forced`: int32 [T, k] picks that replace the router's choice (a routing override); their
    weights are the router's own scores at those experts, normalized as the family does, so a
    forced pick weighs what the router would have given it had it picked it.
    """
    logits = x.astype(jnp.float32) @ p["router"]  # [T, E]
    if c.router_scoring == "softmax":
        scores = choice = jax.nn.softmax(logits, axis=-1)
    elif c.router_scoring == "topk_softmax":  # gpt-oss: biased logits, softmax over the k picked
        scores = choice = logits + p["router_bias"] if c.router_bias else logits
    else:
        scores = jax.nn.sigmoid(logits)
        choice = scores + p["router_bias"] if c.router_bias else scores
        if c.n_group > 1 and c.topk_group < c.n_group:
            choice = _keep_top_groups(choice, c.n_group, c.topk_group)
    ids = jax.lax.top_k(choice, c.num_experts_per_tok)[1] if forced is None else forced
    weights = jnp.take_along_axis(scores, ids, axis=-1)  # top_k's own values, where the router picked
    if c.router_scoring == "topk_softmax":
        weights = jax.nn.softmax(weights, axis=-1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + (1e-20 if c.router_scoring == "sigmoid" else 0.0))
    return ids.astype(jnp.int32), weights * c.routed_scaling_factor


def _keep_top_groups(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """DeepSeek-V3's group stage: a group scores the sum of its two best experts; only the
    best `topk_group` groups stay eligible. With every group kept, the stage is skipped."""
    t, e = choice.shape
    grouped = choice.reshape(t, n_group, e // n_group)
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, n_group]
    _, top_groups = jax.lax.top_k(group_scores, topk_group)
    keep = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], top_groups].set(True)
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(t, e)
