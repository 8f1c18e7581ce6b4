"""A run's arrays as abstract shapes (`jax.ShapeDtypeStruct`s with the `NamedSharding`s a placement
gives them): its weights (4-bit experts in their kernel's layout, slot tables beside them), KV
cache, page pools and MTP pool, each run of layers as the placement's loop holds it, and the bytes
a device holds of them. `moejax plan` compiles the engine's programs over them; nothing is allocated."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import pallas_kernels
from moejax.base.platform import run_dtype
from moejax.config import Config
from moejax.engine.expert_placement import wants_slots
from moejax.engine.kv_cache import init_cache, init_pool
from moejax.model.attention import cache_specs
from moejax.model.mtp import init_mtp_pool
from moejax.model.params import ParamSpec, expert_axis, is_expert_matrix, is_expert_stack, param_dtype, param_specs
from sharding import rules


def _sharded(a, placement, axes: tuple):
    """`a` (a shape) as an abstract array with the sharding its logical axes give it."""
    axes = rules.leaf_axes(axes, a.ndim)
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placement.sharding(axes, a.shape))


def abstract_params(config: Config, placement) -> dict:
    """Every parameter as the run holds it (4-bit experts as their QuantizedArray leaves, expert
    stacks padded to the placement's count of slots, spare slots included), abstract and sharded."""

    def one(spec: ParamSpec):
        shape = list(spec.shape)
        if is_expert_stack(spec):
            shape[expert_axis(spec)] = placement.num_experts
        array = jax.ShapeDtypeStruct(tuple(shape), param_dtype(spec, run_dtype(config.engine.dtype)))
        if is_expert_matrix(spec):
            array = jax.eval_shape(
                functools.partial(
                    pallas_kernels.run_weights,
                    expert_format=config.weights.expert_format,
                    k_slices=placement.k_slices(spec),
                    kernel=config.kernel,
                    gated=spec.gated,
                ),
                array,
            )
        return jax.tree.map(lambda a: _sharded(a, placement, spec.axes), array)

    params = jax.tree.map(one, param_specs(config.model), is_leaf=lambda x: isinstance(x, ParamSpec))
    if wants_slots(config.layout):  # experts in placement slots: the slot tables ride beside them
        for run in params["layers"]:
            if "moe" in run:
                count, spare = jax.tree.leaves(run)[0].shape[0], config.layout.redundant_experts
                table = {"log2phy": (count, placement.num_logical, spare + 1), "logcnt": (count, placement.num_logical)}
                axes = lambda s: ("layers",) + (None,) * (len(s) - 1)
                run["moe"]["slots"] = {
                    k: _sharded(jax.ShapeDtypeStruct(s, jnp.int32), placement, axes(s)) for k, s in table.items()
                }
    return params


def abstract_cache(config: Config, placement, batch: int, context: int) -> list[dict]:
    axes = {k: a for k, (_, a) in cache_specs(config.model, 1, 1).items()}
    cache = jax.eval_shape(
        functools.partial(init_cache, config.model, batch, context, jnp.dtype(run_dtype(config.engine.dtype)))
    )
    return [{k: _sharded(v, placement, ("layers",) + axes[k]) for k, v in run.items()} for run in cache]


def abstract_pool(config: Config, placement, pages: int, page_size: int, window_pages: int = 0) -> list[dict]:
    """A page pool of `pages` pages (and `window_pages` of sliding-window layers'), in the layout
    the placement's attention kernel reads, sharded."""
    pool = jax.eval_shape(
        functools.partial(
            init_pool,
            config.model,
            pages,
            page_size,
            jnp.dtype(run_dtype(config.engine.dtype)),
            placement.attention_kernel,
            window_pages,
        )
    )
    return [
        {k: _sharded(v, placement, axes[k]) for k, v in run.items()}
        for run, axes in zip(pool, placement.cache_axes(pool, pool=True))
    ]


def abstract_mtp_pool(config: Config, placement, pages: int, page_size: int) -> dict:
    """The MTP layer's page pool (MTP drafts: as many pages as the model's), sharded as the model's."""
    pool = jax.eval_shape(
        functools.partial(init_mtp_pool, config.model, pages, page_size, jnp.dtype(run_dtype(config.engine.dtype)))
    )
    axes = placement.cache_axes([pool], pool=True)[0]
    return {k: _sharded(v, placement, axes[k]) for k, v in pool.items()}


def bytes_per_device(tree) -> int:
    """Bytes of one device's shards (the largest, where shards differ); a single device's
    abstract arrays carry no sharding and are held whole."""
    return sum(
        int(np.prod(a.shape if a.sharding is None else a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
        for a in jax.tree.leaves(tree)
    )


def _one_layer(a: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """A layer of an abstract stacked parameter [layers, ...], sharded as the stack's layers are."""
    s = a.sharding
    if isinstance(s, NamedSharding):
        s = NamedSharding(s.mesh, PartitionSpec(*s.spec[1:]))
    return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=s)


def in_loops(params: dict, placement) -> dict:
    """Abstract stacked `params` with each run as the placement's loop holds it: an unrolled run
    a tuple of per-layer trees (a layer's buffers its own), a scanned one its stack."""
    runs = [
        run if loop.stacked else tuple(jax.tree.map(_one_layer, run) for _ in range(jax.tree.leaves(run)[0].shape[0]))
        for loop, run in zip(placement.loops, params["layers"])
    ]
    return {**params, "layers": runs}


def expert_leaves(params: dict) -> list:
    """The arrays of every MoE layer's experts, whether a run is stacked or a tuple of layers."""
    return [
        leaf
        for run in params["layers"]
        for layer in (run if isinstance(run, tuple) else (run,))
        if "moe" in layer
        for leaf in jax.tree.leaves(layer["moe"]["experts"])
    ]


def layer_weight_shapes(params: dict) -> list[tuple[int, ...]]:
    """Each layer weight's shape as a device holds it: its shard, a stacked run's less its layer axis."""
    shapes = []
    for run in params["layers"]:
        for a in jax.tree.leaves(run):
            shape = a.shape if a.sharding is None else a.sharding.shard_shape(a.shape)
            shapes.append(tuple(shape if isinstance(run, tuple) else shape[1:]))
    return shapes
