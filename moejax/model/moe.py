"""The MoE block: router picks, then one call into the placement, plus the shared expert."""

from __future__ import annotations

import jax

from moejax.config import ModelConfig
from moejax.model.layers import ClampedSwiGLU, swiglu
from moejax.model.router import route


def moe_block(p: dict, experts: dict, x: jax.Array, c: ModelConfig, placement) -> tuple[jax.Array, jax.Array]:
    """x: [B, T, D] -> (y: [B, T, D], picks: int32 [B*T, k]). `experts` are the weights the
    placement hands this layer (possibly gathered ahead of time)."""
    b, t, d = x.shape
    rows = x.reshape(b * t, d)
    ids, weights = route(p, rows, c)
    if c.expert_act == "clamped_swiglu":
        experts = {**experts, "act": ClampedSwiGLU(c.swiglu_alpha, c.swiglu_limit)}
    y = placement.moe(rows, ids, weights, experts)
    if c.num_shared_experts:
        y = y + swiglu(rows, p["shared"])
    return y.reshape(b, t, d), ids
