"""Group metadata shared by the grouped GEMM backends.

Convention (megablox `gmm`): `group_sizes` [G] counts the rows of every group; lhs rows are
sorted by group; rhs holds G_local groups, global ids [group_offset, group_offset + G_local).
Rows of other groups and rows past sum(group_sizes) come out zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import ManualAxisType


def local_groups(group_sizes: jax.Array, group_offset, g_local: int, m: int):
    """Returns starts [G_local], sizes [G_local], active [G_local], num_active ().

    starts/sizes are the rows of each local group (clamped to m); active lists the local ids
    of groups with rows first, in order; num_active counts them.
    """
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)  # [G]
    begins = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    offset = jnp.asarray(group_offset, jnp.int32)
    starts = lax.dynamic_slice_in_dim(begins, offset, g_local)
    sizes = lax.dynamic_slice_in_dim(ends, offset, g_local) - starts
    (active,) = jnp.nonzero(sizes > 0, size=g_local, fill_value=0)
    return starts, sizes, active.astype(jnp.int32), jnp.sum(sizes > 0).astype(jnp.int32)


def _varying_axes(like) -> set:
    """The manual mesh axes any array of `like` varies over (none outside `shard_map`)."""
    return set().union(*(jax.typeof(a).manual_axis_type.varying for a in jax.tree.leaves(like)))


def varying_struct(shape: tuple[int, ...], dtype, *like) -> jax.ShapeDtypeStruct:
    """A kernel's output type, varying over the manual mesh axes its inputs `like` vary over:
    inside `shard_map` (check_vma on) a `pallas_call` must declare how its output varies."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=ManualAxisType(varying=frozenset(_varying_axes(like))))


def varying_zeros(shape: tuple[int, ...], dtype, *like) -> jax.Array:
    """Zeros that vary over the manual mesh axes any of `like` varies over. Inside `shard_map`
    (check_vma on) a loop carry must keep its type: an output accumulated from a device's own
    rows and weights varies per device, so its zero start must be declared varying too."""
    axes = _varying_axes(like)
    zeros = jnp.zeros(shape, dtype)
    return lax.pcast(zeros, tuple(sorted(axes)), to="varying") if axes else zeros
