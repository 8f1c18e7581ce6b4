"""Weights travel to the rows: each device keeps E/N experts of every layer at rest and
all-gathers a layer's other experts `prefetch_depth` MoE layers ahead of use, so the gather
overlaps the compute of the layers before it (the decoder's layer scan carries the gathered
layers: `moejax.model.transformer`). Rows never leave their device.
"""

from __future__ import annotations

import jax
import numpy as np

from moejax.base.platform import Platform
from pallas_kernels.layered import layer_slice
from sharding import accounting
from sharding.experts import moe_local
from sharding.mesh import MeshPlacement, own_share


def gather_experts(w: dict) -> dict:
    """Inside shard_map: this device's experts [E/N, ...] -> all experts [E, ...], the same on
    every device of the "ep" axis."""
    return jax.tree.map(lambda a: jax.lax.all_gather(a, "ep", axis=0, tiled=True, to="invarying"), w)


class WeightPrefetch(MeshPlacement):
    """Whole experts, E/N per device at rest (an N x 1 mesh); each layer's experts gathered to
    every device ahead of use."""

    name = "weight_prefetch"
    rows_stay_home = True

    def __init__(self, config, mesh=None, platform: Platform | None = None):
        super().__init__(config, mesh, platform)
        self.prefetch_depth = config.layout.prefetch_depth

    @classmethod
    def mesh_shape(cls, layout):
        return cls.fixed_mesh(layout, (layout.devices, 1))

    def layer_experts(self, stack, i):
        # The all-gather takes the layer as arrays: sliced out of the stack.
        return self.gather_experts(layer_slice(stack, i))

    def gather_experts(self, w):
        return jax.shard_map(
            gather_experts,
            mesh=self.mesh,
            in_specs=(self.expert_specs(w),),
            out_specs=self.expert_specs(w, gathered=True),
        )(w)

    def exchange(self, x, ids, weights, w):
        inner = lambda x, ids, weights: moe_local(
            x,
            ids,
            weights,
            w,
            num_groups=self.num_experts,
            kernel=self.kernel,
            platform=self.platform,
            decode=self.decode,
        )
        return inner(x, ids, weights) if self.rows_sharded else own_share(inner, x, ids, weights)

    def moe(self, x, ids, weights, experts, gathered: bool = True):
        return super().moe(x, ids, weights, experts, gathered=gathered)

    # ------------------------------------------------------------------ accounting
    def bytes_sent_per_device(self, ids, hidden, act_bytes, experts=None):
        if self.devices == 1:
            return np.zeros(1)
        local = accounting.expert_bytes(experts) * self.num_experts / self.devices  # each device's experts
        return np.full(
            self.devices, (self.devices - 1) * local + self.gathered_results_bytes(ids.shape[0], hidden, act_bytes)
        )

    def expert_bytes_read_per_device(self, ids, experts):
        """Each device runs every expert its own rows pick."""
        per_expert = accounting.expert_bytes(experts)
        return np.array([len(np.unique(s)) * per_expert for s in np.array_split(np.asarray(ids), self.devices)])
