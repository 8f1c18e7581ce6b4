"""The router's top-k as one Triton kernel (Pallas), and its XLA twin.

`topk_route` turns router logits [M, E] f32 into each row's k picks and their weights in one
launch, as `moejax.model.router.route` does for the softmax, sigmoid (with a bias choosing but not
weighing) and top-k-softmax scorings, with `norm_topk_prob` and the routed scaling factor; the
DeepSeek group stage is not here (its callers keep XLA). `topk_route_xla` is route's own code.

A program holds [tm, E] of a row tile (E as a power-of-two block, masked) and picks k times the
best expert not picked yet, the lowest index among equal scores: `jax.lax.top_k`'s order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import metadata
from pallas_kernels.tiles import pow2
from pallas_kernels.triton_blocks import iota, load

SCORINGS = ("softmax", "sigmoid", "topk_softmax")


def _check(logits, k: int, scoring: str, bias):
    if scoring not in SCORINGS:
        raise ValueError(f"topk_route: scoring must be one of {SCORINGS}, got {scoring!r}")
    if logits.ndim != 2 or logits.dtype != jnp.float32:
        raise ValueError(f"topk_route: logits must be [M, E] float32, got {logits.dtype} {logits.shape}")
    if not 0 < k <= logits.shape[1]:
        raise ValueError(f"topk_route: k={k} picks out of E={logits.shape[1]} experts")
    if bias is not None and (scoring == "softmax" or bias.shape != logits.shape[1:]):
        raise ValueError(
            f"topk_route: a bias is [E={logits.shape[1]}] and goes with sigmoid or topk_softmax scoring, "
            f"got shape {bias.shape} with {scoring!r}"
        )


def _scores(logits: jax.Array, scoring: str, bias, softmax) -> tuple[jax.Array, jax.Array]:
    """(scores, choice) [.., E]: what a pick weighs, and what picks it (route's)."""
    if scoring == "softmax":
        scores = softmax(logits)
        return scores, scores
    if scoring == "topk_softmax":  # gpt-oss: biased logits, the softmax over the k picked
        scores = logits if bias is None else logits + bias
        return scores, scores
    scores = jax.nn.sigmoid(logits)
    return scores, scores if bias is None else scores + bias


def _weigh(weights: jax.Array, scoring: str, norm_topk_prob: bool, scale: float, softmax, total) -> jax.Array:
    """The picks' scores [.., k] -> their weights, as route finishes them."""
    if scoring == "topk_softmax":
        weights = softmax(weights)
    if norm_topk_prob:
        weights = weights / (total(weights) + (1e-20 if scoring == "sigmoid" else 0.0))
    return weights * scale


def topk_route_xla(
    logits: jax.Array,
    k: int,
    *,
    scoring: str,
    bias: jax.Array | None = None,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """logits [M, E] f32 -> (ids [M, k] int32, weights [M, k] f32), as `route` computes them."""
    _check(logits, k, scoring, bias)
    softmax = functools.partial(jax.nn.softmax, axis=-1)
    scores, choice = _scores(logits, scoring, bias, softmax)
    ids = jax.lax.top_k(choice, k)[1]
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    total = functools.partial(jnp.sum, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), _weigh(weights, scoring, norm_topk_prob, routed_scaling_factor, softmax, total)


def _route_kernel(*refs, m, e, k, tm, scoring, norm_topk_prob, scale):
    """Program r: rows [r * tm, (r + 1) * tm). Refs, its blocks (powers of two, the tails past M,
    E and k masked): logits [tm, E'], bias [1, E'] (where given), ids [tm, k'], weights [tm, k']."""
    logits_ref, *bias_ref, ids_ref, weights_ref = refs
    e_block, k_block = pow2(e), pow2(k)
    in_m = None if m % tm == 0 else iota(tm, 0, pl.program_id(0) * tm) < m  # [tm, 1]
    experts, picks = iota(e_block, 1), iota(k_block, 1)  # [1, E'], [1, k']
    in_e = None if e == e_block else experts < e
    in_k = None if k == k_block else picks < k

    def within(mask, x, fill):  # x where mask (None: everywhere), else fill
        return x if mask is None else jnp.where(mask, x, fill)

    def softmax(x, mask):  # over the columns where mask: the rest weigh 0
        x = within(mask, x, -jnp.inf)
        unnormalized = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
        return unnormalized / jnp.sum(unnormalized, axis=1, keepdims=True)

    logits = load(logits_ref, in_m, in_e)
    bias = load(bias_ref[0], in_e) if bias_ref else None
    scores, choice = _scores(logits, scoring, bias, functools.partial(softmax, mask=in_e))
    # Picks in top_k's order: the best score not taken yet, the lowest index among equals.
    taken = jnp.zeros((tm, e_block), jnp.bool_) if in_e is None else jnp.broadcast_to(~in_e, (tm, e_block))
    ids, weights = jnp.zeros((tm, k_block), jnp.int32), jnp.zeros((tm, k_block), jnp.float32)
    for j in range(k):
        best = jnp.max(jnp.where(taken, -jnp.inf, choice), axis=1, keepdims=True)
        pick = jnp.min(jnp.where(~taken & (choice == best), experts, e_block), axis=1, keepdims=True)  # [tm, 1]
        hit = experts == pick
        taken = taken | hit
        ids = jnp.where(picks == j, pick, ids)
        weights = jnp.where(picks == j, jnp.sum(jnp.where(hit, scores, 0.0), axis=1, keepdims=True), weights)
    weights = _weigh(
        weights,
        scoring,
        norm_topk_prob,
        scale,
        functools.partial(softmax, mask=in_k),
        lambda w: jnp.sum(within(in_k, w, 0.0), axis=1, keepdims=True),
    )
    mask = (
        None
        if in_m is None and in_k is None
        else functools.reduce(jnp.logical_and, [x for x in (in_m, in_k) if x is not None])
    )
    pl_triton.store(ids_ref, ids, mask=mask)
    pl_triton.store(weights_ref, weights, mask=mask)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A call's rows a program (a power of two; fewer rows take the power of two covering them) and
    launch settings (`tiles.lookup("topk_route")`)."""

    rows: int
    num_warps: int
    num_stages: int


def topk_route(
    logits: jax.Array,
    k: int,
    *,
    scoring: str,
    bias: jax.Array | None = None,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    tiles: Tiles,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`topk_route_xla` in one launch: logits [M, E] f32, bias [E] (sigmoid: added to the scores
    to choose; topk_softmax: to the logits) -> (ids [M, k] int32, weights [M, k] f32). tiles: a
    program's rows and launch settings (`Tiles`); interpret: Pallas' interpreter (any platform)."""
    _check(logits, k, scoring, bias)
    rows, num_warps = tiles.rows, tiles.num_warps
    if rows < 1 or rows & (rows - 1) or num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"topk_route: rows and num_warps must be powers of two, got {rows} and {num_warps}")
    m, e = logits.shape
    tm = min(rows, pow2(m))
    operands = (logits,) if bias is None else (logits, bias.reshape(1, e))
    kernel = functools.partial(
        _route_kernel,
        m=m,
        e=e,
        k=k,
        tm=tm,
        scoring=scoring,
        norm_topk_prob=norm_topk_prob,
        scale=routed_scaling_factor,
    )
    return pl.pallas_call(
        kernel,
        out_shape=(
            metadata.varying_struct((m, k), jnp.int32, *operands),
            metadata.varying_struct((m, k), jnp.float32, *operands),
        ),
        grid=(pl.cdiv(m, tm),),
        in_specs=[pl.BlockSpec((tm, pow2(e)), lambda r: (r, 0))]
        + [pl.BlockSpec((1, pow2(e)), lambda r: (0, 0))] * (bias is not None),
        out_specs=[pl.BlockSpec((tm, pow2(k)), lambda r: (r, 0))] * 2,
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=2 * k * m * e, transcendentals=m * e, bytes_accessed=4 * (m * e + e + 2 * m * k)
        ),
    )(*operands)
