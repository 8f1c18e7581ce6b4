"""Block helpers the Triton kernels share (`gmm_pallas_gpu`, `gmm_picks`, `linear`, `routing`):
index ranges, masked loads, and the weights' columns viewed as (gate, up) pairs."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pl_triton


def iota(size: int, axis: int, start=0):
    """start + [0, size) along `axis` of a 2-D [size, 1] or [1, size] block (int32)."""
    return start + lax.broadcasted_iota(jnp.int32, (size, 1) if axis == 0 else (1, size), axis)


def load(ref, *masks):
    """ref's block, zeros where any of `masks` (None: nothing masked) is False."""
    masks = [m for m in masks if m is not None]
    if not masks:
        return ref[...]
    return pl_triton.load(ref, mask=functools.reduce(jnp.logical_and, masks), other=0)


def column_pairs(a, pairs: int):
    """[..., N] -> [..., N/p, p] (a bitcast): the kernel's view of the weights' columns."""
    return a.reshape(*a.shape[:-1], a.shape[-1] // pairs, pairs)
