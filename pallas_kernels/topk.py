"""The router's scoring and top-k, once for every backend: the Triton and Mosaic TPU kernels run
these functions on their blocks, and `topk_route_xla` (the kernels' reference) on whole arrays, as
`moejax.model.router.route` does for the softmax, sigmoid (a bias choosing but not weighing) and
top-k-softmax scorings, with `norm_topk_prob` and the routed scaling factor; the DeepSeek group
stage is not here (its callers keep XLA).

A kernel picks k times the best expert not taken yet, the lowest index among equal scores:
`jax.lax.top_k`'s order, with no sort (`pick`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moejax.vocab import ROUTER_SCORINGS as SCORINGS


def check(logits, k: int, scoring: str, bias):
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


def scores(logits: jax.Array, scoring: str, bias, softmax) -> tuple[jax.Array, jax.Array]:
    """(scores, choice) [.., E]: what a pick weighs, and what picks it (route's)."""
    if scoring == "softmax":
        scores = softmax(logits)
        return scores, scores
    if scoring == "topk_softmax":  # gpt-oss: biased logits, the softmax over the k picked
        scores = logits if bias is None else logits + bias
        return scores, scores
    scores = jax.nn.sigmoid(logits)
    return scores, scores if bias is None else scores + bias


def weigh(weights: jax.Array, scoring: str, norm_topk_prob: bool, scale: float, softmax, total) -> jax.Array:
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
    check(logits, k, scoring, bias)
    softmax = functools.partial(jax.nn.softmax, axis=-1)
    values, choice = scores(logits, scoring, bias, softmax)
    ids = jax.lax.top_k(choice, k)[1]
    weights = jnp.take_along_axis(values, ids, axis=-1)
    total = functools.partial(jnp.sum, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weigh(weights, scoring, norm_topk_prob, routed_scaling_factor, softmax, total)


def pick(
    values: jax.Array, choice: jax.Array, k: int, experts: jax.Array, picks: jax.Array, taken: jax.Array, spread=None
):
    """Each row's k picks in top_k's order: (ids [rows, K'] int32, their values [rows, K'] f32), column j
    < k the j-th pick, the rest 0. values, choice: [rows, E'] (what a pick weighs, what picks it);
    experts: [1, E'] and picks: [1, K'] column iotas; taken: [rows, E'] the columns never to pick
    (a block's masked tail). `spread(v, shape)`: a row reduction [rows] across `shape`'s columns
    (default: as a column [rows, 1]; a Mosaic GPU kernel's register arrays broadcast no [rows, 1])."""
    spread = spread or (lambda v, _: jnp.expand_dims(v, 1))
    width = choice.shape[1]
    ids = jnp.zeros((choice.shape[0], picks.shape[1]), jnp.int32)
    weights = jnp.zeros((choice.shape[0], picks.shape[1]), jnp.float32)
    for j in range(k):
        best = spread(jnp.max(jnp.where(taken, -jnp.inf, choice), axis=1), choice.shape)
        chosen = jnp.min(jnp.where(~taken & (choice == best), experts, width), axis=1)  # [rows]
        hit = experts == spread(chosen, choice.shape)
        taken = taken | hit
        ids = jnp.where(picks == j, spread(chosen, ids.shape), ids)
        weights = jnp.where(picks == j, spread(jnp.sum(jnp.where(hit, values, 0.0), axis=1), ids.shape), weights)
    return ids, weights
