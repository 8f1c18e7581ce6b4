"""How a run of identical layers executes: one `lax.scan` over its parameters stacked
[layers, ...] (`Scan`), or a Python loop over one tree per layer (`Unrolled`: each layer's
arrays their own buffers, where a scan's slice of a weight is a copy on XLA:CPU).

The placement holds one loop per run, chosen once for its platform (`moejax.base.platform.Platform.unrolls`);
the engine arranges its parameters by them, and the decoder, the expert moves and whatever reads
one layer go through them: no code asks which form a run's parameters have.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moejax.model.params import layer_runs
from pallas_kernels import layered
from pallas_kernels.layered import layer_slice


class Scan:
    """A run kept stacked [layers, ...], run as one `lax.scan` (compile time flat in depth)."""

    stacked = True

    def arrange(self, stack):
        """The run's parameters as this loop reads them, from their stack."""
        return stack

    def holds(self, keys: tuple) -> str:
        """How this loop holds the parameter at `keys` of a layer's tree: one "stack" of every layer."""
        return "stack"

    def assemble(self, run):
        """The run from its parameters each loaded as `holds` says (a stack: as is)."""
        return run

    def count(self, run) -> int:
        return jax.tree.leaves(run)[0].shape[0]

    def part(self, run, *keys):
        """The subtree at `keys` of every layer of the run, in this loop's form."""
        for k in keys:
            run = run[k]
        return run

    def with_part(self, run, keys: tuple, part):
        """`run` with `part` (this loop's form) at `keys`, a path of dict keys (the last one new, or replaced)."""
        return _replace(run, keys, part)

    def layer(self, run, i):
        """Layer i of `run` (or of a `part` of it); i may be traced, and past the end is the last."""
        return layer_slice(run, jnp.minimum(i, self.count(run) - 1))

    def experts(self, placement, experts, i):
        """MoE layer i's experts as `placement` computes with them, from the run's at rest."""
        return placement.layer_experts(experts, i)

    def in_place(self, run, i):
        """Layer i of `run` (a `part` of it) for a kernel that reads it where it lies: a
        `layered.LayerOf` of each leaf's stack (a slice of one is a copy for a kernel's operand)."""
        return jax.tree.map(lambda a: layered.LayerOf(a, i), run)

    def loop(self, body, carry, run, *xs):
        """(carry, ys): body(carry, (layer, i, *x[i])) over the run's layers; ys stacked."""
        count = self.count(run)
        return jax.lax.scan(body, carry, (run, jnp.arange(count, dtype=jnp.int32), *xs))


class Unrolled:
    """A run held as a tuple of per-layer trees, run as a Python loop (one program body per layer).

    `groups`: the expert matrices ("moe" / "experts" / name) each layer holds a buffer per group
    (`layered.Groups`), for a kernel that multiplies a group where it lies.
    """

    stacked = False

    def __init__(self, groups: tuple = ()):
        self.groups = groups

    def arrange(self, stack):
        return _layers_of(stack, self.groups)

    def holds(self, keys: tuple) -> str:
        """A tuple of "groups" (a `layered.Groups` a layer) for the expert matrices `groups`, else of "layers"."""
        return "groups" if keys in [("moe", "experts", name) for name in self.groups] else "layers"

    def assemble(self, run):
        """The run from a tree whose leaves are tuples of per-layer values (as `holds` loads them)."""
        leaves = lambda x: isinstance(x, tuple)
        count = len(jax.tree.leaves(run, is_leaf=leaves)[0])
        return tuple(jax.tree.map(lambda layers: layers[i], run, is_leaf=leaves) for i in range(count))

    def count(self, run) -> int:
        return len(run)

    def part(self, run, *keys):
        return tuple(Scan().part(layer, *keys) for layer in run)

    def with_part(self, run, keys: tuple, part):
        return tuple(_replace(layer, keys, p) for layer, p in zip(run, part))

    def layer(self, run, i: int):
        return run[min(i, len(run) - 1)]

    def experts(self, placement, experts, i: int):
        return placement.gather_experts(self.layer(experts, i))

    def in_place(self, run, i: int):
        return self.layer(run, i)

    def loop(self, body, carry, run, *xs):
        """ys: a list, one entry a layer."""
        ys = []
        for i, layer in enumerate(run):
            carry, y = body(carry, (layer, i, *(None if x is None else x[i] for x in xs)))
            ys.append(y)
        return carry, ys


def layer_loops(c, unrolls, groups: tuple = ()) -> tuple:
    """One loop per run of `c`'s layers: `Unrolled` (its experts' `groups` a buffer per group)
    where `unrolls(layers)`, else `Scan`."""
    return tuple(Unrolled(groups) if unrolls(run.count) else Scan() for run in layer_runs(c))


def stacked(c) -> tuple:
    """The loops of parameters as loaded: every run stacked."""
    return layer_loops(c, lambda layers: False)


def arrange(params: dict, loops: tuple) -> dict:
    """`params` (every run stacked) with each run in its loop's form."""
    return {**params, "layers": [loop.arrange(run) for loop, run in zip(loops, params["layers"])]}


def holds(loops: tuple, path: tuple) -> str:
    """How `loops` hold the parameter at `path` of the params tree ("stack" outside the runs)."""
    return loops[path[1]].holds(path[2:]) if path[:1] == ("layers",) else "stack"


def assemble(params: dict, loops: tuple) -> dict:
    """`params` loaded as `holds` says, leaf by leaf, with each run in its loop's form (a tree
    without runs, the MTP module's, as is)."""
    if "layers" not in params:
        return params
    return {**params, "layers": [loop.assemble(run) for loop, run in zip(loops, params["layers"])]}


def _replace(tree: dict, keys: tuple, value) -> dict:
    """`tree` with `value` at the path `keys` (its last key new, or replaced)."""
    head, *rest = keys
    return {**tree, head: _replace(tree[head], tuple(rest), value) if rest else value}


def split_layers(stack) -> tuple:
    """A stacked tree [layers, ...] -> a tuple of per-layer trees (under jit: each its own buffers)."""
    return tuple(layer_slice(stack, i) for i in range(jax.tree.leaves(stack)[0].shape[0]))


def stack_layers(layers: tuple):
    """`split_layers` undone: per-layer trees -> one tree [layers, ...]."""
    return jax.tree.map(lambda *a: jnp.stack(a), *layers)


def cache_layer(run, i):
    """Layer i of a run's contiguous cache, held [layers, ...] or as per-layer trees (`split_layers`)."""
    return run[i] if isinstance(run, tuple) else layer_slice(run, i)


def with_cache_layer(run, i, layer):
    """`run` (as `cache_layer` takes it) with layer i replaced: in place where donated."""
    if isinstance(run, tuple):
        return run[:i] + (layer,) + run[i + 1 :]
    return jax.tree.map(lambda whole, new: jax.lax.dynamic_update_index_in_dim(whole, new, i, 0), run, layer)


@functools.partial(jax.jit, static_argnums=1)
def _layers_of(run, groups: tuple):
    """A run's stacked tree [layers, ...] -> a tuple of per-layer trees, the expert matrices
    `groups` split a buffer per group, in one program (eager slices would be a program per leaf
    shape for a start-up to compile or fetch)."""
    layers, loop = split_layers(run), Unrolled(groups)
    if "moe" in run:
        layers = [
            _replace(
                layer,
                ("moe", "experts"),
                {
                    name: layered.split(w) if loop.holds(("moe", "experts", name)) == "groups" else w
                    for name, w in layer["moe"]["experts"].items()
                },
            )
            for layer in layers
        ]
    return tuple(layers)
