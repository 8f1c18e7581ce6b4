"""The MoE block: router picks, then one call into the placement, plus the shared expert."""

from __future__ import annotations

import jax

from moejax.config import ModelConfig
from moejax.model.layers import ClampedSwiGLU, swiglu
from moejax.model.router import route


def moe_block(
    p: dict, experts: dict, x: jax.Array, c: ModelConfig, placement, forced: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """x: [B, T, D] -> (y: [B, T, D], picks: int32 [B*T, k]). `experts` are the weights the
    placement hands this layer (possibly gathered ahead of time); `forced`: int32 [B*T, k]
    picks replacing the router's (a routing override), None for the router's own. The picks
    returned are logical experts, whichever slots ran them."""
    b, t, d = x.shape
    rows = x.reshape(b * t, d)
    if c.expert_act == "clamped_swiglu":
        experts = {**experts, "act": ClampedSwiGLU(c.swiglu_alpha, c.swiglu_limit)}
    # Named scopes let `moejax trace` attribute the profiler's ops (moejax/analysis/step_trace.py).
    with jax.named_scope("moe"):
        ids, weights = route(p, rows, c, forced)
        # Experts in a placement's slots (`sharding/slots.py`): each pick goes to one replica.
        where = placement.pick_slots(ids, p["slots"]) if "slots" in p else ids
        y = placement.moe(rows, where, weights, experts)
    if c.num_shared_experts:
        y = y + swiglu(rows, p["shared"])
    return y.reshape(b, t, d), ids
