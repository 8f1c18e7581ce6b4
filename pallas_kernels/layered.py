"""How a kernel meets one layer of expert weights: left in its run's stack until a group of it
is read (`LayerOf`), or held as one buffer per group (`Groups`).

A run of identical layers keeps its experts stacked [L, G, K, N] and scans over L. On XLA:CPU,
slicing layer i out of the stack materializes it: a copy of every expert of the layer (192 MB
per layer of the benchmark model, on every decode step) before the loop over touched groups
reads any of them. `LayerOf` defers the slice, so that the XLA grouped GEMM reads group g of
layer i straight from the stack. This module is its one home: a placement asks `layer_of` for a
layer as its kernel reads it (a view only for a kernel that reads groups out of a stack, so no
other kernel meets one), shard_map specs come from `specs`, the XLA kernel reads through
`group`, and the Pallas kernels through `flat` (the stack's groups as one axis). A TPU's router
kernel reads its norm and weight so too (`route_tpu`; a scan's slice of a layer is a copy for a
kernel's operand), and XLA's router, where it runs instead, through `resolved`.

Even a layer of its own is a stack [G, K, N], and the group loop's slice of group g is a copy on
XLA:CPU (a dot reads whole buffers): the weights read once from memory, written, and read again.
An unrolled run on XLA:CPU therefore holds each group of its experts in its own buffer
(`Groups`), and the XLA kernel multiplies the group `lax.switch` picks where it lies.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from pallas_kernels import catalog


@flax.struct.dataclass
class LayerOf:
    """Layer `index` of `stack`: [L, G, K, N], an array or a QuantizedArray."""

    stack: Any
    index: jax.Array  # () int32, may be traced

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    @property
    def ndim(self) -> int:
        return len(self.shape)


@flax.struct.dataclass
class Groups:
    """A layer's [G, K, N] expert matrix as G buffers: `groups`, each [K, N] (array or QuantizedArray)."""

    groups: tuple

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.groups), *self.groups[0].shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)


def split(w) -> Groups:
    """A [G, K, N] array or QuantizedArray -> its groups as `Groups` (under jit: a buffer each)."""
    return Groups(tuple(jax.tree.map(lambda a: a[g], w) for g in range(w.shape[0])))


def layer_of(stack: dict, i, kernel: str, matrices: tuple) -> dict:
    """Layer i (may be traced) of a stacked expert tree {name: [L, G, ...]} as grouped GEMM `kernel`
    reads it: the `matrices` left in their stack (`LayerOf`) where the kernel reads groups out of it
    (its catalog record reads "stack"), every other leaf sliced."""
    view = "stack" in catalog.gemm(kernel).reads
    return {name: LayerOf(a, i) if view and name in matrices else layer_slice(a, i) for name, a in stack.items()}


def specs(rhs, stored_specs, index_spec):
    """shard_map specs of rhs (a layer's array or QuantizedArray, or a LayerOf one):
    `stored_specs(tree, lead)` of the tree it is read from (lead: ("layers",) for a stack, the
    axes ahead of the layer's own), a LayerOf's index `index_spec`."""
    if isinstance(rhs, LayerOf):
        return LayerOf(stored_specs(rhs.stack, ("layers",)), index_spec)
    if isinstance(rhs, Groups):  # each group as its stack would lie, less the groups axis (whole on every device)
        stack = jax.tree.map(lambda a: jax.ShapeDtypeStruct((len(rhs.groups), *a.shape), a.dtype), rhs.groups[0])
        group = jax.tree.map(lambda s: P(*s[1:]), stored_specs(stack, ()), is_leaf=lambda s: isinstance(s, P))
        return Groups((group,) * len(rhs.groups))
    return stored_specs(rhs, ())


def flat(rhs):
    """rhs ([G, K, N] array or QuantizedArray, or a LayerOf either) as a kernel indexes its
    groups: (a LayerOf's stack [L, G, ...] viewed as [L * G, ...] (a bitcast: no layer is copied
    out of it), the layer's first group there, index * G: [1] int32), or (rhs, [0])."""
    if not isinstance(rhs, LayerOf):
        return rhs, jnp.zeros((1,), jnp.int32)
    groups = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), rhs.stack)
    return groups, (jnp.asarray(rhs.index, jnp.int32) * rhs.shape[0]).reshape(1)


def stacked(w) -> tuple:
    """(the stack [L, ...] w is read from, w's layer there: [1] int32): a `LayerOf`'s, or w (an
    array) as a stack of one. For a kernel indexing the layer itself (`flat` multiplies it out, an op
    of its own)."""
    if isinstance(w, LayerOf):
        return w.stack, jnp.asarray(w.index, jnp.int32).reshape(1)
    return w[None], jnp.zeros((1,), jnp.int32)


def resolved(w):
    """w as an array: a `LayerOf`'s layer sliced out of its stack (XLA's ops read it there), else w."""
    return layer_slice(w.stack, w.index) if isinstance(w, LayerOf) else w


def layer_slice(stack, i):
    """Layer i (may be traced) of a stacked tree [L, ...] -> [...]."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), stack)


def group(rhs, g: jax.Array):
    """Group g of rhs ([G, K, N] array or QuantizedArray, or a LayerOf one) -> its [K, N] leaves."""
    if isinstance(rhs, LayerOf):
        lead, rhs = (rhs.index, g), rhs.stack
    else:
        lead = (g,)
    return jax.tree.map(lambda a: _index(a, lead), rhs)


def stored(rhs):
    """The array or QuantizedArray rhs is read from: its stack for a LayerOf, its first group
    for Groups, else itself."""
    if isinstance(rhs, Groups):
        return rhs.groups[0]
    return rhs.stack if isinstance(rhs, LayerOf) else rhs


def _index(a: jax.Array, lead: tuple) -> jax.Array:
    """a[lead] with traced leading indices, as one dynamic slice."""
    start = (*lead, *(0,) * (a.ndim - len(lead)))
    return lax.dynamic_slice(a, start, (*(1,) * len(lead), *a.shape[len(lead) :])).reshape(a.shape[len(lead) :])
