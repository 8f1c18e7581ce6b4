"""Experts into a new placement: every leaf of each MoE layer's expert tree (bf16 matrices, 4-bit
values, block and tensor scales, biases: whatever carries the leading expert axis) moves slot to
slot in one jitted program, device to device over "ep", bit for bit.

Each device gathers one layer's slots at a time and keeps the ones its new slots name, so a
device holds at most one layer's experts beyond its own share while the move runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.model import layer_loop
from moejax.model.params import layer_runs
from sharding import slots


def sources(old: np.ndarray, new: np.ndarray, devices: int) -> np.ndarray:
    """int32 [L, P_new]: the old slot each new slot copies (old int[L, S], new int[L, P_new]
    phy2log), one on the new slot's own device when it has one (nothing travels then)."""
    num_layers, num_old = old.shape
    old_device = np.arange(num_old) // (num_old // devices)
    new_device = np.arange(new.shape[1]) // (new.shape[1] // devices)
    src = np.empty(new.shape, np.int32)
    for l in range(num_layers):
        holds = old[l][None, :] == new[l][:, None]  # [P_new, S]
        if not holds.any(1).all():
            raise ValueError("the new placement names an expert the old one does not hold")
        here = holds & (old_device[None, :] == new_device[:, None])
        src[l] = np.where(here.any(1), here.argmax(1), holds.argmax(1))
    return src


def moved_slots(src: np.ndarray, num_old: int, num_new: int, devices: int) -> int:
    """Slots whose expert came from another device."""
    return int((src // (num_old // devices) != np.arange(num_new) // (num_new // devices)).sum())


def _spec(a: jax.Array, axis: int) -> P:
    """The leaf's own sharding with its expert `axis` split over "ep" (a shard_map spec)."""
    spec = list(a.sharding.spec) if isinstance(a.sharding, NamedSharding) else []
    spec += [None] * (a.ndim - len(spec))
    spec[axis] = "ep"
    return P(*spec)


@functools.cache
def _mover(mesh, stacked: bool, treedef, leaf_specs: tuple):
    """The jitted move of experts of tree `treedef` whose leaves lie as `leaf_specs` (one per
    mesh, tree and layout: a rebalance reuses it). experts: a run's stack (leaves [L, S, ...]) or
    a tuple of layers' trees ([S, ...]); src: int32 [L, P_new] -> the same with P_new slots,
    slot p of layer l a copy of old slot src[l, p]."""

    def local(tree, src):  # per device: its [.., S / n, ..] share -> its [.., P_new / n, ..] share
        if mesh is None:
            mine, gather = src, lambda a: a
        else:
            per = src.shape[1] // jax.lax.axis_size("ep")
            mine = jax.lax.dynamic_slice_in_dim(src, jax.lax.axis_index("ep") * per, per, axis=1)
            gather = lambda a: jax.lax.all_gather(a, "ep", axis=0, tiled=True)
        take = lambda a, l: jnp.take(gather(a), mine[l], axis=0)
        if stacked:
            return jax.tree.map(lambda a: jnp.stack([take(a[l], l) for l in range(a.shape[0])]), tree)
        return tuple(jax.tree.map(lambda a: take(a, l), layer) for l, layer in enumerate(tree))

    if mesh is None:
        return jax.jit(local)
    specs = jax.tree.unflatten(treedef, leaf_specs)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=specs))


def move(placement, experts, src: np.ndarray, stacked: bool):
    """A run's experts (`stacked`, or a tuple of layers) moved to the slots `src` names (`sources`)."""
    leaves, treedef = jax.tree.flatten(experts)
    mesh = getattr(placement, "mesh", None)
    specs = tuple(_spec(a, 1 if stacked else 0) for a in leaves) if mesh is not None else ()
    return _mover(mesh, stacked, treedef, specs)(experts, jnp.asarray(src, jnp.int32))


def put_tables(placement, phy2log: np.ndarray, num_experts: int, stacked: bool = True):
    """The slot tables of `phy2log` int[L, P] on the devices, copied to each (inputs of the
    programs): one tree of [L, ...] arrays, or (not `stacked`) a tuple of one per layer. From
    the host, so a rebalance compiles nothing."""
    host = slots.tables(phy2log, num_experts)
    put = lambda tree: {k: placement.put(v, ("layers",) * (v.ndim - 2) + (None, None)) for k, v in tree.items()}
    return put(host) if stacked else tuple(put({k: v[l] for k, v in host.items()}) for l in range(len(phy2log)))


def moe_runs(c) -> list[int]:
    """Indices into params["layers"] of the MoE runs, in layer order."""
    return [r for r, run in enumerate(layer_runs(c)) if run.is_moe(c)]


def arrange(placement, params: dict, old: np.ndarray, new: np.ndarray, loops: tuple | None = None) -> tuple[dict, int]:
    """`params` with every MoE run's experts moved from phy2log `old` int[L, S] to `new`
    int[L, P] (L: all MoE layers, in order) and the tables of `new` beside them -> (params,
    bytes that changed device). `loops`: how the runs are held (default: stacked, as loaded;
    an engine's: `engine.loops`)."""
    c, devices, moved = placement.config.model, placement.ep, 0
    loops = loops or layer_loop.stacked(c)
    layers, at = list(params["layers"]), 0
    for r in moe_runs(c):
        loop, run = loops[r], layers[r]
        count = loop.count(run)
        o, n = old[at : at + count], new[at : at + count]
        src = sources(o, n, devices)
        experts = loop.part(run, "moe", "experts")
        slot_bytes = sum(a.nbytes for a in jax.tree.leaves(experts)) // (count * o.shape[1])  # one slot of one layer
        moved += moved_slots(src, o.shape[1], n.shape[1], devices) * slot_bytes
        run = loop.with_part(run, ("moe", "experts"), move(placement, experts, src, loop.stacked))
        layers[r] = loop.with_part(run, ("moe", "slots"), put_tables(placement, n, placement.num_logical, loop.stacked))
        at += count
    return {**params, "layers": layers}, moved
