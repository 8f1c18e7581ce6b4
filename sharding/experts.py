"""Local expert compute shared by every placement: group rows by expert, grouped GEMMs, ungroup.

Only the experts a batch picks are read (`pallas_kernels.grouped_gemm` skips empty groups),
which is what makes a decode step bytes-bound rather than compute-bound.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas_kernels
from moejax.model.layers import silu_glu
from pallas_kernels.epilogue import group_rows


def expert_ffn(x: jax.Array, group_sizes: jax.Array, w: dict, *, group_offset=0, kernel: str = "auto",
               first_slice=True) -> jax.Array:
    """x: [M, D] rows sorted by expert; group_sizes: [E_total]; w: gate_up [E, D, 2F] (gate and
    up interleaved: one grouped GEMM for both), down [E, F, D], optional biases gate_up_bias
    [E, 2F], down_bias [E, D] and activation `act(gate, up)` (default silu(gate) * up).

    Rows of experts outside [group_offset, group_offset + E) and rows past sum(group_sizes)
    come out zero. Where F is sliced (K-sliced down projections), every slice's output is a
    partial sum: only the `first_slice` adds the down bias, so the sum has it once.
    """
    gmm = functools.partial(pallas_kernels.grouped_gemm, group_sizes=group_sizes, group_offset=group_offset,
                            backend=kernel, preferred_element_type=x.dtype)
    h = gmm(x, w["gate_up"], bias=w.get("gate_up_bias"), act=w.get("act", silu_glu))  # [M, F]
    y = gmm(h, w["down"])
    if "down_bias" not in w:
        return y
    return y + jnp.where(first_slice, group_rows(w["down_bias"], group_sizes, group_offset, x.shape[0]), 0).astype(y.dtype)


def sort_picks(ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """ids: [T, k] -> (order: [T*k] picks sorted by expert (stable), group_sizes: [num_experts])."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def combine(y_sorted: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """y_sorted: [T*k, D] in pick-sorted order -> [T, D], each row's picks weighted and summed.

    Un-sorting and a per-row weighted sum (rather than a scatter-add) keeps the sum order fixed;
    the rows are un-sorted by a gather through the inverse permutation (scattering rows into a
    zeroed [T*k, D] costs XLA:CPU several times more: the zeros, then the scatter).
    """
    t, k = weights.shape
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = y_sorted[inverse].reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", y.astype(jnp.float32), weights).astype(y_sorted.dtype)


def moe_local(
    x: jax.Array, ids: jax.Array, weights: jax.Array, w: dict, *, num_groups: int | None = None,
    group_offset=0, kernel: str = "auto", first_slice=True,
) -> jax.Array:
    """The experts this device holds, applied to its rows: x: [T, D], ids/weights: [T, k] -> [T, D].

    `w` holds experts [group_offset, group_offset + E_local) of `num_groups` (default: all of
    them); picks of other experts contribute zero, and cost nothing. `first_slice`: see `expert_ffn`.
    """
    order, group_sizes = sort_picks(ids, num_groups or w["down"].shape[0])
    rows = order // ids.shape[1]
    with jax.named_scope("experts"):  # `moejax trace`'s expert GEMM time; the rest of the MoE block is dispatch / combine
        y = expert_ffn(x[rows], group_sizes, w, group_offset=group_offset, kernel=kernel, first_slice=first_slice)
    return combine(y, order, weights)
