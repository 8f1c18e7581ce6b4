"""A TPU decode step's router as one Mosaic TPU kernel: the MoE's RMSNorm, the router's logits, each
row's top-k picks and their weights, with no sort and no scatter.

A TPU core runs a program's ops one after another; XLA's router was some fifteen of them a layer
(the norm's, the logits' product, a sort for top-k, gathers of the picks' scores, the weights'
sums). Here one call holds the rows [T, D], the norm [1, D] and the router's float32 weights [D, E]
in VMEM: it writes the normed rows h [T, D] (which the experts multiply), then picks each row's k
experts in `jax.lax.top_k`'s order (`topk.pick`) and weighs them as `moejax.model.router.route`
does (`topk.scores`, `topk.weigh`). A decode step's rows are few (at most 128): one program.

It also writes the experts kernel's table of which expert's tiles each of its grid steps reads
(`expert_ffn_tpu.expert_slots` of all E experts, on one chip): XLA built it from the picks in some
eight small ops a layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import layered, metadata, topk


def _softmax(x: jax.Array) -> jax.Array:
    """Over the columns (a block's every column is a row's)."""
    unnormalized = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
    return unnormalized / jnp.sum(unnormalized, axis=1, keepdims=True)


def _slots(ids: jax.Array, e: int) -> jax.Array:
    """ids [T, k] int32 -> [1, E] int32, `expert_slots(ids, 0, E)`: g for an expert some row picked,
    else the last picked one before it, else the first picked one. In f32 (exact below 2^24), with the
    [E, E] comparisons a lane-wise scan would otherwise take."""
    experts = lax.broadcasted_iota(jnp.int32, (1, e), 1)
    picked = jnp.zeros((ids.shape[0], e), jnp.float32)
    for j in range(ids.shape[1]):
        picked = jnp.maximum(picked, (experts == ids[:, j : j + 1]).astype(jnp.float32))
    picked = jnp.max(picked, axis=0, keepdims=True)  # [1, E]: whether some row picked expert e
    source = lax.broadcasted_iota(jnp.int32, (e, e), 0).astype(jnp.float32)  # [e, g]: e
    step = lax.broadcasted_iota(jnp.int32, (e, e), 1).astype(jnp.float32)  # [e, g]: g
    picked_col = jnp.max(jnp.where(source == step, picked, 0.0), axis=1, keepdims=True)  # [E, 1]: picked, by e
    before = jnp.max(jnp.where((picked_col > 0) & (source <= step), source, -1.0), axis=0, keepdims=True)
    first = jnp.min(jnp.where(picked > 0, experts.astype(jnp.float32), float(e)), axis=1, keepdims=True)
    return jnp.where(before >= 0, before, jnp.where(first < e, first, 0.0)).astype(jnp.int32)


def _kernel(
    norm_layer, _, x_ref, norms_ref, router_ref, *refs, k, eps, scoring, norm_topk_prob, scale, precision, slots
):
    """Refs: the norm's layer in its stack, the router's (its index map's), x [T, D], the norms' stack
    [L, D], router [D, E] f32, the bias [1, E] where given; out h [T, D], ids [T, k] int32, weights
    [T, k] f32, and `slots`: slot [1, E] int32."""
    *bias_ref, h_ref, ids_ref, weights_ref = refs[: len(refs) - slots]
    slot_ref = refs[-1] if slots else None
    x = x_ref[...]
    xf = x.astype(jnp.float32)
    # The norm's layer: its row of the stack, picked by a sum with zeros (exact), since a block of a
    # row of [L, D] is no whole number of sublane tiles and a copy of the stack as [L, 1, D] an op.
    norms = norms_ref[...]
    rows = lax.broadcasted_iota(jnp.int32, norms.shape, 0)
    norm = jnp.sum(jnp.where(rows == norm_layer[0], norms, 0), axis=0, keepdims=True)  # [1, D]
    # transformers' RMSNorm (`moejax.model.layers.rms_norm`): statistics in f32, the weight in x's dtype
    h = norm * (xf * lax.rsqrt(jnp.mean(xf * xf, axis=1, keepdims=True) + eps)).astype(x.dtype)
    h_ref[...] = h.astype(h_ref.dtype)
    logits = jnp.dot(h.astype(jnp.float32), router_ref[...], preferred_element_type=jnp.float32, precision=precision)
    t, e = logits.shape
    bias = bias_ref[0][...] if bias_ref else None
    values, choice = topk.scores(logits, scoring, bias, _softmax)
    experts, picks = (lax.broadcasted_iota(jnp.int32, (1, n), 1) for n in (e, k))
    ids, weights = topk.pick(values, choice, k, experts, picks, jnp.zeros((t, e), jnp.bool_))
    ids_ref[...] = ids
    if slots:
        slot_ref[...] = _slots(ids, e)
    weights_ref[...] = topk.weigh(
        weights, scoring, norm_topk_prob, scale, _softmax, functools.partial(jnp.sum, axis=1, keepdims=True)
    )


def route_tpu(
    x: jax.Array,
    norm: jax.Array,
    router: jax.Array,
    *,
    k: int,
    eps: float,
    scoring: str,
    bias: jax.Array | None = None,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    precision=None,
    slots: bool = True,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """x [T, D] the residual stream's rows, norm [D] the MoE's RMSNorm weight, router [D, E] f32 (each
    an array, or a `LayerOf` of its run's stack, read where it lies: a layer sliced out of a scan's
    stack is a copy for a kernel's operand), bias [E] (sigmoid: added to the scores to choose;
    topk_softmax: to the logits) -> (h [T, D] the normed
    rows, ids [T, k] int32, weights [T, k] f32, slot [E] int32 or, `slots` False, None), as `rms_norm`
    then `router.route` compute them, and slot as `expert_ffn_tpu.expert_slots(ids, 0, E)` (one
    chip's table of every expert: a mesh's devices hold some). precision: the logits' matmul
    precision (the run's)."""
    t, d = x.shape
    e = router.shape[1]
    topk.check(jax.ShapeDtypeStruct((t, e), jnp.float32), k, scoring, bias)
    (norms, norm_layer), (routers, router_layer) = layered.stacked(norm), layered.stacked(router)
    operands = [x, norms, routers] + ([] if bias is None else [bias.reshape(1, e)])
    whole = pl.BlockSpec(memory_space=pltpu.VMEM)  # the array whole, in VMEM for the call
    layer = pl.BlockSpec((None, d, e), lambda _, n, r: (r[0], 0, 0))  # the router's layer of its stack
    kernel = functools.partial(
        _kernel,
        k=k,
        eps=eps,
        scoring=scoring,
        norm_topk_prob=norm_topk_prob,
        scale=routed_scaling_factor,
        precision=precision,
        slots=slots,
    )
    # VMEM: the operands and outputs once each, the [T, E] scores and choice a few times over, the
    # slot table's [E, E] comparisons.
    vmem = 2 * (2 * x.size * x.dtype.itemsize + d * e * 4) + 16 * t * e * 4 + 8 * e * e * 4 + (4 << 20)
    out_shape = [
        metadata.varying_struct((t, d), x.dtype, *operands),
        metadata.varying_struct((t, k), jnp.int32, *operands),
        metadata.varying_struct((t, k), jnp.float32, *operands),
    ] + [metadata.varying_struct((1, e), jnp.int32, *operands)] * slots
    h, ids, weights, *slot = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            in_specs=[whole, whole, layer] + [whole] * (bias is not None),
            out_specs=(whole,) * len(out_shape),
            grid=(1,),
        ),
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=max(vmem, 16 << 20)),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=2 * t * d * e,
            transcendentals=t * e,
            bytes_accessed=2 * x.size * x.dtype.itemsize + d * e * 4 + 8 * t * k + 4 * e,
        ),
    )(norm_layer, router_layer, *operands)
    return h, ids, weights, slot[0].reshape(e) if slots else None
