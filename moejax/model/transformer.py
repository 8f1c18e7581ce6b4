"""The decoder: embedding, layers (attention + dense MLP or MoE), final norm, LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.config import ModelConfig
from moejax.model.attention import attention
from moejax.model.layers import rms_norm, rope_cos_sin, swiglu
from moejax.model.moe import moe_block

ROWS = ("batch", "seq", "embed")


def decoder_layer(lp: dict, experts, x: jax.Array, positions, cos_sin, cache: dict, selected, c: ModelConfig, placement,
                  window: int = 0):
    """One layer (attention + dense MLP or MoE) on x: [B, T, D] -> (x, cache, selected, picks or None).
    `experts`: the MoE layer's expert weights from the placement; `selected`: DSA selection;
    `window`: the layer's sliding window (0: full attention)."""
    h = rms_norm(x, lp["attn_norm"], c.rms_norm_eps)
    a, cache, selected = attention(lp["attn"], h, positions, cos_sin, cache, c, placement, selected, window)
    x = placement.constrain(x + a, ROWS)
    h = rms_norm(x, lp["mlp_norm"], c.rms_norm_eps)
    ids = None
    if "moe" in lp:
        m, ids = moe_block(lp["moe"], experts, h, c, placement)
    else:
        m = swiglu(h, lp["mlp"])
    return placement.constrain(x + m, ROWS), cache, selected, ids


def forward(params: dict, cache: list, tokens: jax.Array, positions: jax.Array, c: ModelConfig, placement):
    """tokens, positions: [B, T] -> (hidden: [B, T, D] after the final norm, cache, picks).

    picks: one int32 [B*T, k] array per MoE layer (the router's choices, for recording).
    """
    x = placement.constrain(params["embed"][tokens], ROWS)
    cos_sin = rope_cos_sin(c, positions)
    experts = iter(placement.expert_weights([lp["moe"]["experts"] for lp in params["layers"] if "moe" in lp]))
    new_cache, picks, selected = [], [], None
    for i, (lp, layer_cache) in enumerate(zip(params["layers"], cache)):
        window = c.sliding_window if i in c.sliding_layers else 0
        x, layer_cache, selected, ids = decoder_layer(
            lp, next(experts) if "moe" in lp else None, x, positions, cos_sin, layer_cache, selected, c, placement,
            window,
        )
        new_cache.append(layer_cache)
        if ids is not None:
            picks.append(ids)
    return rms_norm(x, params["final_norm"], c.rms_norm_eps), new_cache, picks


def lm_head(params: dict, h: jax.Array, c: ModelConfig) -> jax.Array:
    """h: [..., D] -> float32 logits [..., V]."""
    w = params["embed"].T if c.tie_word_embeddings else params["lm_head"]
    return (h @ w).astype(jnp.float32)
