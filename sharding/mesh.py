"""What every placement on a device mesh shares: the ("ep", "tp") mesh, the logical-axis
rules of `rules.py` for parameters, cache and activations, and running its exchange under
`shard_map`. A placement class adds its mesh shape and its exchange (`exchange`)."""

from __future__ import annotations

import abc

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.base.platform import Platform
from moejax.config import Config, ConfigError, LayoutConfig
from moejax.model import paged
from pallas_kernels import catalog, layered
from sharding import rules
from sharding.placement import Placement

EXPERT_AXES = {
    "gate_up": ("experts", "embed", "expert_mlp"),
    "down": ("experts", "expert_mlp", "embed"),
    "gate_up_bias": ("experts", "expert_mlp"),
    "down_bias": ("experts", "embed"),
    "act": (),  # the experts' activation (no arrays)
    "slot": (None,),  # the router kernel's table of the tiles each experts-kernel step reads: one chip's
}


def make_mesh(shape: tuple[int, int], devices: list | None = None) -> Mesh:
    """An ("ep", "tp") mesh over `devices` (default: the machine's first ep * tp devices)."""
    n = shape[0] * shape[1]
    devices = jax.devices() if devices is None else list(devices)
    if len(devices) < n:
        raise ConfigError(f"the layout needs {n} devices, this machine has {len(devices)}")
    # Devices in the order of their physical links, a mesh axis free to span several of a TPU
    # torus's axes (a hybrid 4 x 16 on a v6e 8 x 8 does). Auto axes: the placements state
    # shardings as constraints and in shard_map specs and let GSPMD propagate the rest (Explicit
    # axes would put shardings in every array's type).
    ordered = mesh_utils.create_device_mesh(shape, devices[:n], allow_split_physical_axes=True)
    return Mesh(ordered, rules.ALL, axis_types=(AxisType.Auto,) * 2)


class MeshPlacement(Placement, abc.ABC):
    """A placement over an ("ep", "tp") mesh; subclasses give `mesh_shape` and `exchange`."""

    def __init__(self, config: Config, mesh: Mesh | None = None, platform: Platform | None = None):
        layout = config.layout
        # Before the base's: the kernel is chosen for a device's widths, on the mesh's first device.
        self.ep, self.tp = self.mesh_shape(layout)
        self.mesh = mesh or make_mesh((self.ep, self.tp))
        super().__init__(config, platform)
        rules.check_model(config.model, self.ep, self.tp, config.weights.expert_format)
        self.table = rules.rules(layout)
        self.sizes = dict(self.mesh.shape)
        if layout.redundant_experts % self.ep:
            raise ConfigError(
                f"layout.redundant_experts {layout.redundant_experts} must be a multiple of ep "
                f"({self.ep}): each device holds as many slots"
            )
        self.set_slots(rules.padded_experts(config.model.num_experts, self.ep))
        self.rows_sharded = layout.attention == "dp"
        self.two_batch_overlap = layout.two_batch_overlap
        if self.two_batch_overlap and self.rows_stay_home:
            raise ConfigError(
                f"two_batch_overlap splits the rows' exchange; under {self.name} rows stay on their "
                "device (its weight gathers already run layers ahead)"
            )

    @property
    def first_device(self):
        return self.mesh.devices.flat[0]

    @classmethod
    @abc.abstractmethod
    def mesh_shape(cls, layout: LayoutConfig) -> tuple[int, int]:
        """(ep, tp) of this placement on `layout.devices` devices."""

    @classmethod
    def fixed_mesh(cls, layout: LayoutConfig, shape: tuple[int, int]) -> tuple[int, int]:
        """`shape`, after checking that the layout does not ask for another one."""
        asked = (layout.ep or shape[0], layout.tp or shape[1])
        if asked != shape:
            raise ConfigError(
                f"{cls.name} runs on a {shape[0]} x {shape[1]} (ep x tp) mesh of {layout.devices} "
                f"devices; ep={layout.ep} tp={layout.tp} do not apply to it"
            )
        return shape

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

    def constrain(self, x, axes):
        return jax.lax.with_sharding_constraint(x, self.sharding(axes, x.shape))

    @property
    def row_shards(self):
        return self.devices if self.rows_sharded else 1

    def lies_whole(self, group):
        mapped = [self.table[axis] for axis in rules.DENSE_GROUP_AXES[group]]
        return all(rules.devices(axes, self.sizes) == 1 for axes in mapped if axes is not None)

    def per_device(self, kernel, rows, whole):
        """kernel(rows, whole) under shard_map: each device its share of the rows [M, ...] (split as
        the batch is, where M divides; else every row on every device), the weights `whole` as each
        device holds them (whole: `lies_whole`), the outputs [M, ...] split as the rows."""
        lead = next(x for x in jax.tree.leaves(rows))
        split = P(self.spec(("batch",), lead.shape[:1])[0])
        # check_vma off: a pallas_call's outputs carry no varying-axes types.
        return jax.shard_map(kernel, mesh=self.mesh, in_specs=(split, P()), out_specs=split, check_vma=False)(
            rows, whole
        )

    def on_pages(self, fn, q, k, v, positions, pages, pool: dict, sinks=None):
        """Under shard_map: each device its requests (DP attention; their pages are on its rank;
        rows too few to split run on every device, answered by the rank of their pages) or its
        heads (TP attention, where the pool's kv heads slice, the sinks' heads with them; else
        every head on every device), the run's pools [layers, pages, ...] as they lie."""
        axes = self.cache_axes([pool], pool=True)[0]
        pool_specs = {name: self.spec(axes[name], a.shape) for name, a in pool.items()}
        name = next(iter(pool))
        heads = pool_specs[name][1 + {"kv": paged.KV_POOL_AXES}.get(name, axes[name][1:]).index("kv_heads")]
        rows = self.spec(("batch",), q.shape[:1])[0]
        split = pool_specs[name][1] is not None  # the pages axis: each rank its own
        local_pages = pool[name].shape[1] // (self.devices if split else 1)
        pages = paged.LayerPages(pages.table, jnp.asarray(pages.layer, jnp.int32))

        per_device = self._on_own_pages(fn, split, rows, local_pages, pages_at=4)
        heads_spec, rows_spec = P(rows, None, heads, None), P(rows, None)
        pages_spec = paged.LayerPages(rows_spec, P())
        # The sinks [H] slice as q's heads do (none: an argument fewer).
        sinks_args, sinks_specs = ((), ()) if sinks is None else ((sinks,), (P(heads),))
        # check_vma off: a pallas_call's outputs carry no varying-axes types.
        return jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(heads_spec, heads_spec, heads_spec, rows_spec, pages_spec, pool_specs, *sinks_specs),
            out_specs=(heads_spec, pool_specs),
            check_vma=False,
        )(q, k, v, positions, pages, pool, *sinks_args)

    def on_latent(self, fn, q, q_rope, latent, k_rope, positions, pages, pool: dict, keep=None):
        """`on_pages` for MLA: each device its requests (DP attention) or its query heads (TP
        attention; the latent is every head's, each device holds all of it), the run's pools as
        they lie."""
        axes = self.cache_axes([pool], pool=True)[0]
        pool_specs = {name: self.spec(axes[name], a.shape) for name, a in pool.items()}
        rows = self.spec(("batch",), q.shape[:1])[0]
        heads = self.spec(("heads",), q.shape[2:3])[0]
        split = pool_specs["latent"][1] is not None  # the pages axis: each rank its own
        local_pages = pool["latent"].shape[1] // (self.devices if split else 1)
        pages = paged.LayerPages(pages.table, jnp.asarray(pages.layer, jnp.int32))
        per_device = self._on_own_pages(fn, split, rows, local_pages, pages_at=5)
        heads_spec, new_spec, rows_spec = P(rows, None, heads, None), P(rows, None, None), P(rows, None)
        keep_args, keep_specs = ((), ()) if keep is None else ((keep,), (new_spec,))
        return jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(
                heads_spec,
                heads_spec,
                new_spec,
                new_spec,
                rows_spec,
                paged.LayerPages(rows_spec, P()),
                pool_specs,
                *keep_specs,
            ),
            out_specs=(heads_spec, pool_specs),
            check_vma=False,
        )(q, q_rope, latent, k_rope, positions, pages, pool, *keep_args)

    @staticmethod
    def _on_own_pages(fn, split: bool, rows, local_pages: int, pages_at: int):
        """fn(first_page, *args) -> (out [B, ...], pool) as one device's program under `on_pages`'
        shard_map: its first page (`split`: the pages axis split over the ranks), and where every
        device runs every row (`rows` None), each row's answer from the rank holding its pages
        (args[pages_at]: the `paged.LayerPages`)."""

        def per_device(*args):
            first = jax.lax.axis_index(rules.ALL) * local_pages if split else jnp.int32(0)
            out, pool = fn(first, *args)
            if split and rows is None:  # every device runs every row: the rank holding a row's pages answers
                own = jnp.any(paged.local(args[pages_at].table, first, local_pages) < local_pages, axis=1)  # [B]
                out = jax.lax.psum(jnp.where(own.reshape(-1, *[1] * (out.ndim - 1)), out, 0), rules.ALL)
            return out, pool

        return per_device

    def store_pages(self, pool, new, positions, pages, seq_axis, view=True):
        """Under DP attention (the pool's pages axis split over every device) under shard_map: each
        rank writes and reads only its own pages (a plain gather on the split pool had XLA move
        pages between devices every layer). Rows replicated (a prefill call of fewer rows than
        ranks): each device reads its own pages of every row, zeros for the rest, and the views
        are summed over the devices (the rows' pages, never the pool)."""
        lead = 1 if isinstance(pages, paged.LayerPages) else 0
        n = pool.shape[lead]
        if self.table["pages"] is None or n % self.devices:
            return super().store_pages(pool, new, positions, pages, seq_axis, view)
        local_pages = n // self.devices
        rows = self.spec(("batch",), new.shape[:1])[0]
        pool_spec = P(*[None] * lead, rules.ALL)
        table = pages.table if lead else pages
        layer = jnp.asarray(pages.layer, jnp.int32) if lead else jnp.int32(0)

        def per_device(pool, new, positions, table, layer):
            at = paged.LayerPages(table, layer) if lead else table
            out = paged.store(jax.lax.axis_index(rules.ALL) * local_pages, pool, new, positions, at, seq_axis, view)
            if view and rows is None:
                return out[0], jax.lax.psum(out[1], rules.ALL)
            return out

        return jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(pool_spec, P(rows), P(rows), P(rows), P()),
            out_specs=(pool_spec, P(rows)) if view else pool_spec,
            check_vma=False,
        )(pool, new, positions, table, layer)

    def copy_pages(self, cache, source, target):
        """Under DP attention each device copies the pairs on its own pages (a pair never spans ranks)."""
        specs = [
            {k: self.spec(axes[k], v.shape) for k, v in run.items()}
            for run, axes in zip(cache, self.cache_axes(cache, pool=True))
        ]
        if any(spec[1] is None for run in specs for spec in run.values()):  # the pages axis is not split
            return super().copy_pages(cache, source, target)

        def per_device(cache, source, target):
            rank = jax.lax.axis_index(rules.ALL)  # each entry's pages here: its group's share
            return [
                {
                    k: paged.copy(
                        v,
                        paged.local(paged.ids_for(source, k), rank * v.shape[1], v.shape[1]),
                        paged.local(paged.ids_for(target, k), rank * v.shape[1], v.shape[1]),
                    )
                    for k, v in run.items()
                }
                for run in cache
            ]

        return jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(specs, jax.tree.map(lambda _: P(), source), jax.tree.map(lambda _: P(), target)),
            out_specs=specs,
            check_vma=False,
        )(cache, source, target)

    def batch_multiple(self) -> int:
        return self.devices if self.rows_sharded else 1

    # ------------------------------------------------------------------ the MoE exchange
    def expert_specs(self, w: dict, gathered: bool = False) -> dict:
        """Per-leaf PartitionSpecs of one layer's experts (4-bit leaves keep their rank);
        `gathered`: every device holds every expert."""

        def leaf_specs(name, tree):
            axes = EXPERT_AXES[name] if not gathered else (None,) + EXPERT_AXES[name][1:]
            stored = lambda t, lead: jax.tree.map(
                lambda a: self.spec(rules.leaf_axes((*lead, *axes), a.ndim), a.shape), t
            )
            return layered.specs(tree, stored, P())  # a layer left in its run's stack: a replicated index

        return {name: leaf_specs(name, tree) for name, tree in w.items()}

    def row_spec(self, ndim: int) -> P:
        return P(rules.ALL if self.rows_sharded else None, *([None] * (ndim - 1)))

    @abc.abstractmethod
    def exchange(self, x, ids, weights, w):
        """Inside shard_map, per device: its rows x: [T_local, D] (all T rows when rows are
        replicated), ids/weights: [T_local, k], its experts w -> [T_local, D]."""

    @property
    def kernels_take_varying_operands(self) -> bool:
        """Whether the MoE's kernels (its grouped GEMM, and its decode set where it has one) take
        operands typed as varying over the mesh axes: shard_map's check is off where one does not."""
        records = [catalog.gemm(self.kernel)]
        records += [catalog.kernel(catalog.DECODE, self.decode.kernel)] if self.decode.kernel != "xla" else []
        return all(r.varying_operands for r in records)

    def moe(self, x, ids, weights, experts, gathered: bool = False):
        row = self.row_spec(2)
        return jax.shard_map(
            self.exchange,
            mesh=self.mesh,
            in_specs=(row, row, row, self.expert_specs(experts, gathered)),
            out_specs=row,
            check_vma=self.kernels_take_varying_operands,
        )(x, ids, weights, experts)

    # ------------------------------------------------------------------ accounting
    def gathered_results_bytes(self, t: int, hidden: int, act_bytes: int) -> float:
        """Bytes a device sends to hand its share's results to every device when rows are
        replicated (TP attention) but the exchange runs on each device's own share."""
        return 0.0 if self.rows_sharded else (self.devices - 1) * -(-t // self.devices) * hidden * act_bytes


def own_share(inner, x, ids, weights):
    """Rows replicated (TP attention): each device runs `inner(x, ids, weights)` on its 1/N share,
    then all-gather."""
    n, me = jax.lax.axis_size(rules.ALL), jax.lax.axis_index(rules.ALL)
    t = x.shape[0]
    share = -(-t // n)
    pad = lambda a, v: jnp.pad(a, [(0, share * n - t)] + [(0, 0)] * (a.ndim - 1), constant_values=v)
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, me * share, share)
    y = inner(take(pad(x, 0)), take(pad(ids, 0)), take(pad(weights, 0.0)))
    return jax.lax.all_gather(y, rules.ALL, tiled=True, to="invarying")[:t]
