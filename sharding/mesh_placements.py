"""Placements on a device mesh: the logical-axis rules of `rules.py` for parameters, cache
and activations, and one exchange algorithm per placement for the MoE layer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.config import Config, ConfigError
from sharding import rules
from sharding.experts import moe_local
from sharding.gather_scatter import gather_scatter
from sharding.placement import Placement
from sharding.ragged_a2a import ragged_a2a
from sharding.weight_prefetch import PrefetchedExperts, gather_experts

EXPERT_AXES = {"gate": ("experts", "embed", "expert_mlp"), "up": ("experts", "embed", "expert_mlp"),
               "down": ("experts", "expert_mlp", "embed"),
               "gate_bias": ("experts", "expert_mlp"), "up_bias": ("experts", "expert_mlp"),
               "down_bias": ("experts", "embed"),
               "act": ()}  # the experts' activation (no arrays)


def make_mesh(shape: tuple[int, int]) -> Mesh:
    n = shape[0] * shape[1]
    devices = jax.devices()
    if len(devices) < n:
        raise ConfigError(f"the layout needs {n} devices, this machine has {len(devices)}")
    return Mesh(np.array(devices[:n]).reshape(shape), ("ep", "tp"))


class MeshPlacement(Placement):
    def __init__(self, config: Config, mesh: Mesh | None = None, use_ragged: bool | None = None):
        super().__init__(config)
        layout = config.layout
        self.name = layout.experts
        self.ep, self.tp = rules.mesh_shape(layout)
        rules.check_model(config.model, self.ep, self.tp, config.weights.expert_format)
        self.mesh = mesh or make_mesh((self.ep, self.tp))
        self.table = rules.rules(layout)
        self.sizes = dict(self.mesh.shape)
        self.num_experts = rules.padded_experts(config.model.num_experts, self.ep)
        self.rows_sharded = layout.attention == "dp"
        # XLA:CPU has no ragged-all-to-all; elsewhere only the used slots travel.
        self.use_ragged = jax.default_backend() != "cpu" if use_ragged is None else use_ragged

    # ------------------------------------------------------------------ shardings
    def spec(self, axes: tuple, shape: tuple) -> P:
        return rules.partition_spec(axes, shape, self.table, self.sizes)

    def sharding(self, axes: tuple, shape: tuple) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape))

    def put(self, array, axes):
        """Each device takes its own block of the host array: works when the mesh spans
        several processes (multi-host), where device_put of a whole array cannot."""
        host = np.asarray(array)
        return jax.make_array_from_callback(host.shape, self.sharding(axes, host.shape), lambda index: host[index])

    def place_cache(self, cache):
        from moejax.model.attention import cache_specs

        axes = {k: a for k, (_, a) in cache_specs(self.config.model, 1, 1).items()}
        return [{k: self.put(v, axes[k]) for k, v in layer.items()} for layer in cache]

    def constrain(self, x, axes):
        return jax.lax.with_sharding_constraint(x, self.sharding(axes, x.shape))

    def batch_multiple(self) -> int:
        return self.ep * self.tp if self.rows_sharded else 1

    # ------------------------------------------------------------------ the MoE exchange
    def _expert_specs(self, w: dict, gathered: bool = False) -> dict:
        """Per-leaf PartitionSpecs of one layer's experts (4-bit leaves keep their rank)."""
        def leaf_specs(name, tree):
            axes = EXPERT_AXES[name] if not gathered else (None,) + EXPERT_AXES[name][1:]
            return jax.tree.map(lambda a: self.spec(axes, a.shape), tree)
        return {name: leaf_specs(name, tree) for name, tree in w.items()}

    def _row_spec(self, ndim: int) -> P:
        return P(rules.ALL if self.rows_sharded else None, *([None] * (ndim - 1)))

    def expert_weights(self, layers):
        if self.name != "weight_prefetch":
            return layers

        def gather(w):
            return jax.shard_map(
                functools.partial(gather_experts, axis="ep"), mesh=self.mesh,
                in_specs=(self._expert_specs(w),), out_specs=self._expert_specs(w, gathered=True), check_vma=False,
            )(w)

        return PrefetchedExperts(layers, gather, self.config.layout.prefetch_depth)

    def moe(self, x, ids, weights, experts):
        layout = self.config.layout
        gathered = self.name == "weight_prefetch"
        if self.name in ("tensor_sliced", "expert_sharded", "hybrid"):
            body = functools.partial(gather_scatter, rows_sharded=self.rows_sharded, num_experts=self.num_experts,
                                     kernel=self.kernel)
        else:
            if self.name == "ragged_a2a":
                inner = functools.partial(ragged_a2a, num_experts=self.num_experts, dispatch_dtype=layout.dispatch_dtype,
                                          use_ragged=self.use_ragged, kernel=self.kernel)
            else:
                inner = functools.partial(_moe_all_local, num_experts=self.num_experts, kernel=self.kernel)
            body = inner if self.rows_sharded else functools.partial(_own_share, inner)
        row = self._row_spec(2)
        return jax.shard_map(
            body, mesh=self.mesh, in_specs=(row, row, row, self._expert_specs(experts, gathered)), out_specs=row,
            check_vma=False,
        )(x, ids, weights, experts)


def _moe_all_local(x, ids, weights, w, *, num_experts, kernel):
    return moe_local(x, ids, weights, w, num_groups=num_experts, kernel=kernel)


def _own_share(inner, x, ids, weights, w):
    """Rows replicated (TP attention): each device handles its 1/N share, then all-gather."""
    n, me = jax.lax.axis_size(rules.ALL), jax.lax.axis_index(rules.ALL)
    t = x.shape[0]
    share = -(-t // n)
    pad = lambda a, v: jnp.pad(a, [(0, share * n - t)] + [(0, 0)] * (a.ndim - 1), constant_values=v)
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, me * share, share)
    y = inner(take(pad(x, 0)), take(pad(ids, 0)), take(pad(weights, 0.0)), w)
    return jax.lax.all_gather(y, rules.ALL, tiled=True)[:t]
