"""The one seam between the model and the placements.

The MoE block computes router picks and calls `placement.moe(x, ids, weights, experts)`;
attention and dense code call `placement.constrain(x, logical_axes)`. The base class is the
single-device reference every placement must agree with.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from moejax.config import Config
from sharding.experts import moe_local


class Placement:
    """Single device: no mesh, every expert local."""

    name = "single"

    def __init__(self, config: Config):
        self.config = config
        self.kernel = config.kernel

    def place(self, spec, array) -> jax.Array:
        """Puts one parameter (logical axes `spec.axes`) on its devices."""
        return jax.device_put(array)

    def place_cache(self, cache: list[dict]) -> list[dict]:
        return cache

    def constrain(self, x: jax.Array, axes: tuple) -> jax.Array:
        """Activation sharding by logical axis names (no-op without a mesh)."""
        return x

    def expert_weights(self, layers: Sequence[dict]) -> Sequence[dict]:
        """The expert weights each MoE layer computes with, in layer order. A placement that
        moves weights (weight_prefetch) returns a sequence that issues its gathers ahead."""
        return layers

    def moe(self, x: jax.Array, ids: jax.Array, weights: jax.Array, experts: dict) -> jax.Array:
        """x: [T, D], ids/weights: [T, k] -> [T, D]: the routed experts' weighted sum per row."""
        return moe_local(x, ids, weights, experts, kernel=self.kernel)


def make_placement(config: Config) -> Placement:
    if config.layout.devices == 1:
        return Placement(config)
    from sharding.mesh_placements import make_mesh_placement

    return make_mesh_placement(config)
