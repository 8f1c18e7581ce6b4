"""One layer of a stack of expert weights, left unsliced until a kernel reads a group of it.

A run of identical layers keeps its experts stacked [L, G, K, N] and scans over L. On XLA:CPU,
slicing layer i out of the stack materializes it: a copy of every expert of the layer (192 MB
per layer of the benchmark model, on every decode step) before the loop over touched groups
reads any of them. `LayerOf` defers the slice, so that the XLA grouped GEMM reads group g of
layer i straight from the stack; other kernels take the layer whole (`whole`).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
from jax import lax


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

    def whole(self):
        """The layer as its own [G, K, N] (a copy on XLA:CPU)."""
        return layer_slice(self.stack, self.index)


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
    """The array or QuantizedArray rhs is read from: its stack for a LayerOf, else itself."""
    return rhs.stack if isinstance(rhs, LayerOf) else rhs


def take(rhs, ids: jax.Array) -> jax.Array:
    """Groups ids [M] of rhs (a [G, K, N] array, or a LayerOf one) -> [M, K, N], as one gather."""
    if isinstance(rhs, LayerOf):
        return rhs.stack[rhs.index, ids]
    return rhs[ids]


def _index(a: jax.Array, lead: tuple) -> jax.Array:
    """a[lead] with traced leading indices, as one dynamic slice."""
    start = (*lead, *(0,) * (a.ndim - len(lead)))
    return lax.dynamic_slice(a, start, (*(1,) * len(lead), *a.shape[len(lead):])).reshape(a.shape[len(lead):])


def unwrap(rhs):
    """rhs as a [G, K, N] array or QuantizedArray (materializing a LayerOf)."""
    return rhs.whole() if isinstance(rhs, LayerOf) else rhs
