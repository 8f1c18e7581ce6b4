"""The one seam between the model and the placements.

The MoE block computes router picks and calls `placement.moe(x, ids, weights, experts)`;
attention and dense code call `placement.constrain(x, logical_axes)`. The base class is the
single-device reference every placement must agree with, and the shape every placement
class fills in: its mesh, its rules, its exchange, its bytes accounting and the simulator's
cost hooks (`sharding/registry.py` lists the placements).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moejax.base.platform import DENSE_GROUPS, DecodeKernels, Platform, resolve
from moejax.config import Config, ConfigError
from moejax.model import paged
from moejax.model.attention import cache_specs
from moejax.model.layer_loop import layer_loops
from moejax.model.params import ParamSpec, expert_axis, is_expert_matrix, is_expert_stack, param_specs
from moejax.model.projections import dense_widths
from pallas_kernels import catalog, layered
from sharding import accounting, rules, slots
from sharding.experts import moe_local

GEMM_WEIGHTS = ("gate_up", "down")  # the expert matrices `expert_ffn` multiplies by


class Placement:
    """Single device: no mesh, every expert local."""

    name = "single"
    ep = tp = 1
    # Simulator cost hook: rows never leave their device, and each device runs its own rows'
    # picks on every expert (gathered to it); otherwise a device runs every pick of the experts
    # it holds (`moejax.analysis.simulate.device_work`).
    rows_stay_home = False
    # Whether the layout's ep / tp choose this placement's mesh (else the placement fixes it).
    mesh_from_layout = False
    # Whether the exchange runs as two micro-batches (`sharding/overlap.py`); one device has none.
    two_batch_overlap = False

    def __init__(self, config: Config, platform: Platform | None = None):
        self.config = config
        # The decisions of the platform the programs are built for: this machine's, or another
        # one a program is compiled for (`moejax plan --target`); the kernel "auto" stands for, ...
        self.platform = platform or resolve()
        self.kernel = gemm_kernel(config, self.platform, self.tp, self.first_device)
        self.attention_kernel = paged_kernel(config, self.platform, self.first_device)
        # How each run of layers executes there (a scan, or unrolled): the engine arranges its
        # parameters by these, and the decoder runs them so (`moejax/model/layer_loop.py`).
        # Where every device holds every expert and the kernel multiplies a group where it lies (on
        # XLA:CPU: `Platform.buffers_apart`), an unrolled run holds each group of its experts in its
        # own buffers (`pallas_kernels/layered.py`).
        groups = (
            GEMM_WEIGHTS
            if self.holds_every_expert and "groups" in catalog.gemm(self.kernel).reads and self.platform.buffers_apart
            else ()
        )
        self.loops = layer_loops(
            config.model, lambda layers: self.platform.unrolls(config.engine.layer_loop, layers), groups
        )
        self.set_slots(config.model.num_experts)

    @functools.cached_property
    def decode(self) -> DecodeKernels:
        """How a decode step's small products run: XLA's ops, or the fused decode kernels its grouped
        GEMM's record names (`moejax/model/projections.py`, `sharding/experts.py`): a GPU's, a layer's
        dense products among them on one device; a TPU's experts as one call, and its router."""
        dtype = self.platform.run_dtype(self.config.engine.dtype)
        fmt, shapes = self.config.weights.expert_format, expert_shapes(self.config.model, self.tp)
        # The first set this jax can build (Triton's: its backend) that multiplies these experts; none:
        # XLA's ops (a run of this grouped GEMM may take none: it multiplies other rows).
        sets = (catalog.kernel(catalog.DECODE, name) for name in catalog.gemm(self.kernel).decode)
        runs = lambda r: r.why_not(self.platform.name, self.first_device, dtype, fmt, shapes) is None  # noqa: E731
        record = next(filter(runs, sets), None)
        if record is None:
            return self.platform.decode_kernels(None, dtype, self.first_device)
        # The dense kernel, the top-k and the router kernel (the set's own backend: they run where the
        # set does), each on its device's rows (`per_device`), for the groups whose weights lie whole
        # on each and which the dense kernel multiplies.
        return self.platform.decode_kernels(
            record.name,
            dtype,
            self.first_device,
            dense=frozenset(g for g in DENSE_GROUPS if self.lies_whole(g) and self._dense_takes(record, g, dtype)),
            linear=record.dense,
            linear_reads_stacks=record.dense is not None
            and "stack" in catalog.kernel(catalog.DECODE, record.dense).reads,
            topk=record.topk,
            whole_ffn=record.whole_ffn,
            router=self._router(record, dtype),
            per_device=None if self.devices == 1 else self.per_device,  # a mesh placement's
            row_shards=self.row_shards,
        )

    def _dense_takes(self, record: catalog.Kernel, group: str, dtype) -> bool:
        """Whether decode set `record`'s dense kernel multiplies `group`'s products (the router's in
        float32) at the model's widths, and MLA's attention with its epilogues."""
        if record.dense is None:
            return False
        dense = catalog.kernel(catalog.DECODE, record.dense)
        if group == "attention" and self.config.model.is_mla and not dense.latent_heads:
            return False
        dtype = "float32" if group == "router" else dtype
        widths = dense_widths(self.config.model, group)
        return dense.why_not(self.platform.name, self.first_device, dtype, "unquantized", widths) is None

    def _router(self, record: catalog.Kernel, dtype) -> str | None:
        """Decode set `record`'s router kernel where it takes the model's router (its record's checks:
        its widths among them), else None: XLA's router (or the dense kernel's product and top-k)."""
        if record.router is None:
            return None
        widths = dense_widths(self.config.model, "router")
        router = catalog.kernel(catalog.DECODE, record.router)
        return (
            record.router
            if router.why_not(self.platform.name, self.first_device, dtype, shapes=widths) is None
            else None
        )

    row_shards = 1  # the devices a pass's rows split over (DP attention on a mesh)

    def lies_whole(self, group: str) -> bool:
        """Whether the weights of dense group `group` (`platform.DENSE_GROUPS`) lie whole on each device."""
        return True

    @property
    def first_device(self):
        """The device the placement's programs start on (kind and cores: the decode kernels' tiles)."""
        return jax.devices()[0]

    def set_slots(self, num_logical: int) -> None:
        """Logical experts (padding included) and the physical slots holding them: one each, plus
        `layout.redundant_experts` spare slots for replicas (`sharding/slots.py`)."""
        self.num_logical = num_logical
        self.num_experts = num_logical + self.config.layout.redundant_experts  # slots: what the exchange indexes

    @property
    def devices(self) -> int:
        return self.ep * self.tp

    # ------------------------------------------------------------------ where arrays live
    def sharding(self, axes: tuple, shape: tuple):
        """Where an array with these logical axes lives (None: the default device)."""
        return None

    def cache_axes(self, cache, pool: bool = False) -> list[dict]:
        """Logical axes of each array of cache dicts (a run's, with a leading layers axis, or one
        layer's); `pool`: page pools (`model/paged.py`) rather than contiguous rows."""
        c = self.config.model
        axes = {k: a for k, (_, a) in cache_specs(c, 1, 1).items()}
        if pool:
            axes = {k: tuple(paged.CONTIGUOUS_TO_PAGED.get(n, n) for n in a) for k, a in axes.items()}
            # The interleaved k/v pool slices by whole heads (a k and its v), or not at all.
            whole = c.num_kv_heads % self.devices == 0
            axes["kv"] = tuple(n if whole or n != "kv_heads" else None for n in paged.KV_POOL_AXES)
        # A window group's entries (`paged.WINDOW`) lie as the full group's.
        return [
            {k: ("layers",) * (v.ndim - len(axes[paged.base(k)])) + axes[paged.base(k)] for k, v in layer.items()}
            for layer in cache
        ]

    def k_slices(self, spec: ParamSpec) -> int:
        return k_slices(spec, self.tp)

    def put(self, array, axes: tuple) -> jax.Array:
        """One array onto its devices (every process passes the same host array)."""
        return jax.device_put(array, self.sharding(axes, array.shape))

    def place(self, spec: ParamSpec, value) -> jax.Array:
        """One parameter (an array, or a 4-bit tree of arrays) onto its devices; expert stacks
        padded with empty experts up to `num_logical` (never picked), in checkpoint order
        (`sharding/moves.py` moves them into a placement's slots)."""
        return jax.tree.map(lambda a: self.put(a, rules.leaf_axes(spec.axes, a.ndim)), self._padded(spec, value))

    def place_groups(self, spec: ParamSpec, value) -> layered.Groups:
        """One layer's expert matrix [E, K, N] (host array or 4-bit tree) onto its devices as an
        unrolled run holds it: a buffer per expert (`layered.Groups`), padded as `place` pads."""
        one = dataclasses.replace(spec, shape=spec.shape[1:], axes=spec.axes[1:])
        return layered.Groups(tuple(self.place(one, w) for w in layered.split(self._padded(spec, value)).groups))

    def _padded(self, spec: ParamSpec, value):
        """An expert stack with empty experts appended up to `num_logical`; any other parameter as is."""

        def pad(a):
            ax = expert_axis(spec)
            if a.shape[ax] >= self.num_logical:
                return a
            widths = [(0, 0)] * a.ndim
            widths[ax] = (0, self.num_logical - a.shape[ax])
            return jnp.pad(a, widths) if isinstance(a, jax.Array) else np.pad(np.asarray(a), widths)

        return jax.tree.map(pad, value) if is_expert_stack(spec) else value

    def cache_shardings(self, cache, pool: bool = False) -> list[dict]:
        """Where this placement keeps each array of cache dicts or page pools (for one placed elsewhere)."""
        return [
            {k: self.sharding(axes[k], v.shape) for k, v in layer.items()}
            for layer, axes in zip(cache, self.cache_axes(cache, pool))
        ]

    def zeros_cache(self, init: Callable[[], list[dict]], pool: bool = False) -> list[dict]:
        """The zero cache dicts (or page pools) `init()` makes, each device making its own block
        where this placement keeps it (no whole cache on one device, no copy through the host)."""
        shapes = jax.eval_shape(init)
        return [
            {k: jnp.zeros(s.shape, s.dtype, device=where[k]) for k, s in layer.items()}
            for layer, where in zip(shapes, self.cache_shardings(shapes, pool))
        ]

    def batch_multiple(self) -> int:
        """Batch sizes must be a multiple of this (requests split over devices)."""
        return 1

    def constrain(self, x: jax.Array, axes: tuple) -> jax.Array:
        """Activation sharding by logical axis names (no-op without a mesh)."""
        return x

    def on_pages(self, fn, q, k, v, positions, pages, pool: dict, sinks=None):
        """fn(first_page, q, k, v, positions, pages, pool, sinks) -> (out, pool) run on each device's
        own requests, heads and pages (a Pallas kernel is one device's program): q [B, T, H, Dh],
        k, v [B, T, H_kv, Dh], positions [B, T], pages: `paged.LayerPages` (tables [B, P] of global
        page ids) into the run's pools [layers, pages, ...], sinks: [H] per-head logits (sliced as
        q's heads) or None; first_page: the first page this device holds."""
        return fn(jnp.int32(0), q, k, v, positions, pages, pool, sinks)

    def on_latent(self, fn, q, q_rope, latent, k_rope, positions, pages, pool: dict, keep=None):
        """MLA's `on_pages`: fn(first_page, q, q_rope, latent, k_rope, positions, pages, pool, keep)
        -> (out, pool) on each device's own requests, heads and pages: q [B, T, H, C], q_rope
        [B, T, H, R], the new latent [B, T, C] and k_rope [B, T, R], positions [B, T], pages:
        `paged.LayerPages` into the run's pools latent and k_rope, keep: bool [B, T, S] or None."""
        return fn(jnp.int32(0), q, q_rope, latent, k_rope, positions, pages, pool, keep)

    def store_pages(self, pool: jax.Array, new, positions, pages, seq_axis: int, view: bool = True):
        """`paged.store` on each device's own pages of one pool entry ([pages, ...], or a run's
        [layers, pages, ...] with `paged.LayerPages`): new [B, T, ...] at positions [B, T]
        -> (pool, the rows' pages as a contiguous view) or, `view` False, the pool."""
        return paged.store(jnp.int32(0), pool, new, positions, pages, seq_axis, view)

    def copy_pages(self, cache: list[dict], source, target) -> list[dict]:
        """Page pools [layers, pages, ...] with the pages `source` [F] copied into `target` [F]
        (global ids, each pair on one rank; id N: none; `paged.Tables` of ids with page groups)."""
        return [
            {k: paged.copy(v, paged.ids_for(source, k), paged.ids_for(target, k)) for k, v in run.items()}
            for run in cache
        ]

    # ------------------------------------------------------------------ the MoE exchange
    # MoE layers ahead that a placement moving weights to the rows gathers them (the decoder's
    # layer scan carries that many gathered layers); 0 gathers each layer's weights at its use.
    prefetch_depth = 0

    def layer_experts(self, stack: dict, i) -> dict:
        """MoE layer i's experts, out of its run's stack [L, E, ...], as `moe` takes them: as this
        placement's kernel reads a layer of a stack (`pallas_kernels/layered.py`)."""
        return layered.layer_of(stack, i, self.kernel, GEMM_WEIGHTS)

    def gather_experts(self, w: dict) -> dict:
        """The experts a device computes one MoE layer with, from those at rest on it: the same
        ones for placements that keep weights in place, every expert for one that moves them."""
        return w

    # Whether every device holds (a slice of) every expert: then expert placement does not apply.
    holds_every_expert = False
    # Whether a pick of a replicated expert takes a replica on its row's own device first (rows
    # that travel to their experts); else picks spread over the replicas.
    home_replicas = False

    def pick_slots(self, ids: jax.Array, table: dict) -> jax.Array:
        """Logical picks ids: [T, k] -> the physical slots they run on, by one layer's slot `table`."""
        return slots.pick_slots(ids, table, self.ep, home=self.home_replicas)

    def moe(self, x: jax.Array, ids: jax.Array, weights: jax.Array, experts: dict) -> jax.Array:
        """x: [T, D], ids (physical slots)/weights: [T, k] -> [T, D]: the routed experts' weighted sum per row."""
        return moe_local(x, ids, weights, experts, kernel=self.kernel, platform=self.platform, decode=self.decode)

    # ------------------------------------------------------------------ accounting
    # For one MoE layer and one forward pass: ids [T, k] are the picks of every row of the pass,
    # laid out over devices as the placement lays rows out; one number per device.
    sent_source = "collective sizes"  # where `bytes_sent_per_device` comes from (compare labels it)

    def bytes_sent_per_device(self, ids: np.ndarray, hidden: int, act_bytes: int, experts: dict | None = None):
        return np.zeros(self.devices)

    def exchange_buffer_bytes(self, rows: int, hidden: int, act_bytes: int) -> dict[str, int]:
        """Bytes of the buffers one device allocates for its exchange in one MoE layer of a pass
        of `rows` rows (all devices'), by buffer; none for an exchange of plain collectives."""
        return {}

    def copies_per_row(self, ids: np.ndarray) -> float:
        """Mean number of other devices a row is sent to (Row-Meets-Experts's 'copies')."""
        return float(self.devices - 1)

    def expert_bytes_read_per_device(self, ids: np.ndarray, experts: dict) -> np.ndarray:
        """Expert weight bytes each device reads in one layer: its share of every touched expert."""
        touched = np.unique(ids)
        e_local = self.num_experts // self.ep
        group = np.bincount(touched // e_local, minlength=self.ep)  # touched experts per ep group
        return np.repeat(group * accounting.expert_bytes(experts) / self.tp, self.tp).astype(float)


def k_slices(spec: ParamSpec, tp: int) -> int:
    """K-slices a 4-bit expert stack is packed in: its reduction axis is sliced tp ways."""
    return tp if spec.axes[-2:-1] == ("expert_mlp",) else 1


def gemm_kernel(config: Config, platform: Platform, tp: int, device=None) -> str:
    """The grouped GEMM of `config.kernel` on `platform`'s `device` (a compile target's, or this
    machine's first) with the experts' per-device widths on `tp` devices: "auto" takes the first of
    the platform's candidates whose catalog record finds it runnable (this jax's backends, the run's
    dtype, the experts' format and widths, the GPU's architecture), else the XLA path; a kernel
    named for what it cannot run is refused with the reason."""
    dtype = platform.run_dtype(config.engine.dtype)
    fmt = config.weights.expert_format
    shapes = expert_shapes(config.model, tp)
    for name in platform.gemm_candidates(config.kernel, device):
        refusal = catalog.gemm(name).why_not(platform.name, device or jax.devices()[0], dtype, fmt, shapes)
        if refusal is None:
            return name
        if config.kernel != "auto":
            raise ConfigError(f"kernel {name}: {refusal}")
    return "xla"


def expert_shapes(model, tp: int) -> list[tuple[int, int, bool]]:
    """(K, N, gated) of each expert matrix a device multiplies by with `tp`-way tensor slicing (the
    experts' hidden axis sliced: K of a down stack, N of a gate|up one)."""
    specs = jax.tree.leaves(param_specs(model), is_leaf=lambda x: isinstance(x, ParamSpec))
    return sorted(
        {
            (s.shape[-2] // k_slices(s, tp), s.shape[-1] // (tp if s.axes[-1] == "expert_mlp" else 1), s.gated)
            for s in specs
            if is_expert_matrix(s)
        }
    )


def paged_kernel(config: Config, platform: Platform, device=None) -> str:
    """The paged-attention kernel of `config.attention_kernel` on `platform`'s `device` (a compile
    target's, or this machine's first). "auto" takes the XLA path where this jax cannot build the
    kernel, the device cannot run it (an Ampere GPU: no TMA) or it cannot read the model's cache
    (under DP attention too: each rank's requests hold the rank's own pages, which its kernel
    reads); a kernel named for what it cannot run is refused with the reason."""
    name = platform.attention_kernel(config.attention_kernel)
    refusal = (
        None
        if name == "xla"
        else catalog.attention(name).why_not(platform.name, device or jax.devices()[0])
        or paged.kernel_refusal(config.model, name, platform.run_dtype(config.engine.dtype))
    )
    if refusal and config.attention_kernel != "auto":
        raise ConfigError(
            f"attention kernel {name}: {refusal}; this model reads its pages through XLA "
            "(--attention-kernel xla or auto)"
        )
    return "xla" if refusal else name
