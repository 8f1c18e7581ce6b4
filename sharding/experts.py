"""Local expert compute shared by every placement: group rows by expert, grouped GEMMs, ungroup.

Only the experts a batch picks are read (`pallas_kernels.grouped_gemm` skips empty groups),
which is what makes a decode step bytes-bound rather than compute-bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels


def expert_ffn(x: jax.Array, group_sizes: jax.Array, w: dict, *, group_offset=0, kernel: str = "auto") -> jax.Array:
    """x: [M, D] rows sorted by expert; group_sizes: [E_total]; w: gate/up [E, D, F], down [E, F, D].

    Rows of experts outside [group_offset, group_offset + E) and rows past sum(group_sizes)
    come out zero.
    """
    gmm = lambda lhs, rhs: pallas_kernels.grouped_gemm(
        lhs, rhs, group_sizes, group_offset=group_offset, backend=kernel, preferred_element_type=x.dtype
    )
    h = jax.nn.silu(gmm(x, w["gate"])) * gmm(x, w["up"])
    return gmm(h, w["down"])


def sort_picks(ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """ids: [T, k] -> (order: [T*k] picks sorted by expert (stable), group_sizes: [num_experts])."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def combine(y_sorted: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """y_sorted: [T*k, D] in pick-sorted order -> [T, D], each row's picks weighted and summed.

    Un-sorting and a per-row weighted sum (rather than a scatter-add) keeps the sum order fixed.
    """
    t, k = weights.shape
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", y.astype(jnp.float32), weights).astype(y_sorted.dtype)


def moe_local(
    x: jax.Array, ids: jax.Array, weights: jax.Array, w: dict, *, num_groups: int | None = None,
    group_offset=0, kernel: str = "auto",
) -> jax.Array:
    """The experts this device holds, applied to its rows: x: [T, D], ids/weights: [T, k] -> [T, D].

    `w` holds experts [group_offset, group_offset + E_local) of `num_groups` (default: all of
    them); picks of other experts contribute zero, and cost nothing.
    """
    order, group_sizes = sort_picks(ids, num_groups or w["gate"].shape[0])
    rows = order // ids.shape[1]
    y = expert_ffn(x[rows], group_sizes, w, group_offset=group_offset, kernel=kernel)
    return combine(y, order, weights)
