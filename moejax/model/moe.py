"""The MoE block: router picks, then one call into the placement, plus the shared expert."""

from __future__ import annotations

import jax

from moejax.config import ModelConfig
from moejax.model import projections
from moejax.model.layers import ClampedSwiGLU


def moe_block(
    p: dict,
    experts: dict,
    x: jax.Array,
    norm: jax.Array,
    c: ModelConfig,
    placement,
    forced: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """x: [B, T, D] the residual stream, `norm` the MLP norm's weight -> (x + the MoE of the normed
    x: [B, T, D], picks: int32 [B*T, k]). `experts` are the weights the placement hands this layer
    (possibly gathered ahead of time); `forced`: int32 [B*T, k] picks replacing the router's (a
    routing override), None for the router's own. The picks returned are logical experts,
    whichever slots ran them."""
    b, t, d = x.shape
    if c.expert_act == "clamped_swiglu":
        experts = {**experts, "act": ClampedSwiGLU(c.swiglu_alpha, c.swiglu_limit)}
    # Named scopes let `moejax trace` attribute the profiler's ops (moejax/analysis/step_trace.py).
    with jax.named_scope("moe"):
        rows, ids, weights, table = projections.route(placement.decode, p, x.reshape(b * t, d), norm, c, forced)
        # Experts in a placement's slots (`sharding/slots.py`): each pick goes to one replica.
        where = placement.pick_slots(ids, p["slots"]) if "slots" in p else ids
        if table is not None and "slots" not in p:  # the router kernel's table of the picks the experts take
            experts = {**experts, "slot": table}
        y = placement.moe(rows, where, weights, experts)
    if c.num_shared_experts:
        y = y + projections.mlp(placement, p["shared"], rows, group="shared_mlp")
    return x + y.reshape(b, t, d), ids
