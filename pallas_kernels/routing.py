"""The router's top-k as one Triton kernel (Pallas).

`topk_route` turns router logits [M, E] f32 into each row's k picks and their weights in one
launch, as `moejax.model.router.route` does (`topk`: the scorings, the picks, `topk_route_xla`).
A program holds [tm, E] of a row tile (E as a power-of-two block, masked).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import metadata, topk
from pallas_kernels.tiles import pow2
from pallas_kernels.triton_blocks import iota, load


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
    values, choice = topk.scores(logits, scoring, bias, functools.partial(softmax, mask=in_e))
    taken = jnp.zeros((tm, e_block), jnp.bool_) if in_e is None else jnp.broadcast_to(~in_e, (tm, e_block))
    ids, weights = topk.pick(values, choice, k, experts, picks, taken)
    weights = topk.weigh(
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
    topk.check(logits, k, scoring, bias)
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
