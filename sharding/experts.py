"""Local expert compute shared by every placement: group rows by expert, grouped GEMMs, ungroup.

Only the experts a batch picks are read (`pallas_kernels.grouped_gemm` skips empty groups),
which is what makes a decode step bytes-bound rather than compute-bound.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas_kernels
from moejax.base.platform import XLA, DecodeKernels, Platform
from moejax.model.layers import silu_glu


def expert_ffn(
    x: jax.Array,
    group_sizes: jax.Array,
    w: dict,
    *,
    picks,
    kernel: str,
    platform: Platform,
    group_offset=0,
    first_slice=True,
) -> jax.Array:
    """x: [T, D] tokens; group_sizes: [E_total] of their T*k picks sorted by expert; w: gate_up [E,
    D, 2F] (gate and up interleaved: one grouped GEMM for both), down [E, F, D], optional biases
    gate_up_bias [E, 2F], down_bias [E, D] and activation `act(gate, up)` (default silu(gate) *
    up); picks: (order [T*k], weights [T, k]) -> [T, D]: the gate|up product reads each sorted
    pick's token row, the down product weights and sums each token's picks (`pallas_kernels.grouped_gemm`).

    Picks of experts outside [group_offset, group_offset + E) and rows past sum(group_sizes)
    contribute zero. Where F is sliced (K-sliced down projections), every slice's output is a
    partial sum: only the `first_slice` adds the down bias, so the sum has it once. `kernel`
    (resolved: not "auto") runs as on `platform`, the one the program is built for: its XLA path's
    rows and the run's matmul precision are the platform's decisions.
    """
    gmm = functools.partial(
        pallas_kernels.grouped_gemm,
        group_sizes=group_sizes,
        group_offset=group_offset,
        backend=kernel,
        preferred_element_type=x.dtype,
        gemm_rows=platform.gemm_rows,
        precision=platform.matmul_precision(x.dtype),
    )
    order, weights = picks
    h = gmm(
        x, w["gate_up"], bias=w.get("gate_up_bias"), act=w.get("act", silu_glu), lhs_rows=order // weights.shape[1]
    )  # [T*k, F]
    down_bias = w.get("down_bias")
    return gmm(h, w["down"], bias=None if down_bias is None else jnp.where(first_slice, down_bias, 0), combine=picks)


def expert_ffn_by_pick(
    x: jax.Array, ids: jax.Array, weights: jax.Array, w: dict, *, group_offset, first_slice, decode: DecodeKernels
) -> jax.Array:
    """`expert_ffn` of a decode step's few rows, each pick multiplied by its expert where it lies (no
    sort, no group metadata): x: [T, D], ids, weights: [T, k] -> [T, D]. As one call where the decode
    set runs the experts whole (`pallas_kernels.expert_ffn`), else two pick GEMMs
    (`pallas_kernels.pick_gemm`) whose down product's [T*k, D] rows are weighted and summed per token
    in float32, as `epilogue.combine` sums the sorted products."""
    down_bias = w.get("down_bias")
    down_bias = None if down_bias is None else jnp.where(first_slice, down_bias, 0)
    if decode.whole_ffn:
        return pallas_kernels.expert_ffn(
            x,
            ids,
            weights,
            w,
            group_offset=group_offset,
            backend=decode.kernel,
            act=w.get("act", silu_glu),
            down_bias=down_bias,
            slot=w.get("slot"),
            precision=decode.precision,
            device=decode.device,
        )
    t, k = ids.shape
    gemm = functools.partial(
        pallas_kernels.pick_gemm,
        ids=ids.reshape(-1),
        k=k,
        group_offset=group_offset,
        out_dtype=x.dtype,
        backend=decode.kernel,
        precision=decode.precision,
        device=decode.device,
    )
    h = gemm(x, w["gate_up"], bias=w.get("gate_up_bias"), act=w.get("act", silu_glu))  # [T*k, F]
    y = gemm(h, w["down"], bias=down_bias, rows_are_picks=True)  # [T*k, D]
    return jnp.einsum("tkd,tk->td", y.reshape(t, k, -1).astype(jnp.float32), weights).astype(x.dtype)


def sort_picks(ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """ids: [T, k] -> (order: [T*k] picks sorted by expert (stable), group_sizes: [num_experts])."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def moe_local(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    w: dict,
    *,
    kernel: str,
    platform: Platform,
    num_groups: int | None = None,
    group_offset=0,
    first_slice=True,
    decode: DecodeKernels = XLA,
) -> jax.Array:
    """The experts this device holds, applied to its rows: x: [T, D], ids/weights: [T, k] -> [T, D].

    `w` holds experts [group_offset, group_offset + E_local) of `num_groups` (default: all of
    them); picks of other experts contribute zero, and cost nothing. `kernel`, `platform`, `first_slice`: see
    `expert_ffn`; `decode`: the decode kernels, which multiply a decode step's rows by pick (`expert_ffn_by_pick`).
    """
    if decode.fuses(x.shape[0]):
        with jax.named_scope("experts"):
            return expert_ffn_by_pick(
                x, ids, weights, w, group_offset=group_offset, first_slice=first_slice, decode=decode
            )
    order, group_sizes = sort_picks(ids, num_groups or w["down"].shape[0])
    with jax.named_scope(
        "experts"
    ):  # `moejax trace`'s expert GEMM time; the rest of the MoE block is dispatch / combine
        return expert_ffn(
            x,
            group_sizes,
            w,
            picks=(order, weights),
            group_offset=group_offset,
            kernel=kernel,
            first_slice=first_slice,
            platform=platform,
        )
