"""The one seam between the model and the placements.

The MoE block computes router picks and calls `placement.moe(x, ids, weights, experts)`;
attention and dense code call `placement.constrain(x, logical_axes)`. The base class is the
single-device reference every placement must agree with.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

import pallas_kernels
from moejax.config import Config
from sharding.experts import moe_local


class Placement:
    """Single device: no mesh, every expert local."""

    name = "single"
    ep = tp = 1

    def __init__(self, config: Config):
        self.config = config
        self.kernel = config.kernel
        self.num_experts = config.model.num_experts  # including padding experts, if any

    def sharding(self, axes: tuple, shape: tuple):
        """Where an array with these logical axes lives (None: the default device)."""
        return None

    def k_slices(self, spec) -> int:
        """K-slices a 4-bit expert stack is packed in: its reduction axis is sliced tp ways."""
        return self.tp if spec.axes[-2] == "expert_mlp" else 1

    def put(self, array, axes: tuple) -> jax.Array:
        """One array onto its devices (every process passes the same host array)."""
        return jax.device_put(array, self.sharding(axes, array.shape))

    def place(self, spec, array) -> jax.Array:
        """Puts one parameter on its devices: expert stacks padded to `num_experts` and,
        with `weights.expert_format` nvfp4/mxfp4, quantized along their reduction axis."""
        if spec.axes[:1] != ("experts",):
            return self.put(array, spec.axes)
        if array.shape[0] < self.num_experts:  # empty padding experts: never picked
            array = np.pad(np.asarray(array), [(0, self.num_experts - array.shape[0])] + [(0, 0)] * (array.ndim - 1))
        fmt = self.config.weights.expert_format
        if fmt != "bf16":
            array = quantize_in_slices(jax.numpy.asarray(array, jax.numpy.float32), fmt, self.k_slices(spec))
        return jax.tree.map(lambda a: self.put(a, spec.axes), array)

    def place_cache(self, cache: list[dict]) -> list[dict]:
        return cache

    def batch_multiple(self) -> int:
        """Batch sizes must be a multiple of this (requests split over devices)."""
        return 1

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


def quantize_in_slices(w: jax.Array, fmt: str, slices: int):
    """Quantizes experts w: [E, K, N] along K as `slices` independent K-slices, laid end to end.

    A packed byte holds two values of its own slice, so a device holding K-slice j of every
    expert holds a complete 4-bit matrix (down projections under tensor slicing). Blocks
    never straddle slices and NVFP4's tensor scale stays per expert, so the values and
    scales are those of quantizing each whole matrix."""
    e, k, n = w.shape
    q = pallas_kernels.quantize(w.reshape(e, slices, k // slices, n), fmt, axis=-2, tensor_axes=(-3, -2, -1))
    return q.replace(values=q.values.reshape(e, -1, n), scales=q.scales.reshape(e, -1, n),
                     tensor_scale=None if q.tensor_scale is None else q.tensor_scale.reshape(e, 1, 1))


def make_placement(config: Config) -> Placement:
    if config.layout.devices == 1:
        return Placement(config)
    from sharding.mesh_placements import MeshPlacement

    return MeshPlacement(config)
