"""The decoder: embedding, layers (attention + dense MLP or MoE), final norm, LM head.

Layers run as one `lax.scan` per run of identical layers (`params.layer_runs`) over their
stacked parameters and cache, so compile time and memory do not grow with depth; or, where the
engine unstacked a run's parameters into one tree per layer (`unstack_layers`, XLA:CPU), as a
Python loop over them, the same step body either way. A placement
that moves expert weights to the rows (`placement.prefetch_depth` > 0) has the scan carry the
experts gathered for the next `prefetch_depth` MoE layers: iteration i computes with weights
gathered `prefetch_depth` iterations earlier and issues the gather for layer i + depth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.config import ModelConfig
from moejax.model import paged
from moejax.model.attention import attention
from moejax.model.layers import rms_norm, rope_cos_sin, swiglu
from moejax.model.moe import moe_block
from moejax.model.params import Run, layer_runs
from pallas_kernels.layered import layer_slice

ROWS = ("batch", "seq", "embed")


def decoder_layer(lp: dict, experts, x: jax.Array, positions, cos_sin, cache: dict, selected, c: ModelConfig, placement,
                  window=0, forced=None, pages=None):
    """One layer (attention + dense MLP or MoE) on x: [B, T, D] -> (x, cache, selected, picks or None).
    `experts`: the MoE layer's expert weights as the placement computes with them; `selected`:
    the DSA selection of the layer before; `window`: its sliding window (0: full attention);
    `forced`: int32 [B*T, k] picks replacing the router's (None: the router's own); `pages`: the
    block table [B, P] of a paged cache (None: contiguous)."""
    h = rms_norm(x, lp["attn_norm"], c.rms_norm_eps)
    with jax.named_scope("attention"):  # for `moejax trace`
        a, cache, selected = attention(lp["attn"], h, positions, cos_sin, cache, c, placement, selected, window, pages)
    x = placement.constrain(x + a, ROWS)
    h = rms_norm(x, lp["mlp_norm"], c.rms_norm_eps)
    ids = None
    if "moe" in lp:
        m, ids = moe_block(lp["moe"], experts, h, c, placement, forced)
    else:
        m = swiglu(h, lp["mlp"])
    return placement.constrain(x + m, ROWS), cache, selected, ids


def run_layers(run: Run, run_params, run_cache: dict, x, selected, positions, cos_sin, c: ModelConfig,
               placement, forced=None, pages=None):
    """One run of identical layers: x: [B, T, D] -> (x, run_cache, selected, picks: int32
    [layers, B*T, k] of a MoE run (a list of [B*T, k] where unrolled), else None).
    `run_params`: stacked [layers, ...] (scanned), or a tuple of per-layer trees (unrolled);
    `forced`: a MoE run's int32 [layers, B*T, k] picks replacing the router's, or None."""
    count = run.count
    unrolled = isinstance(run_params, tuple)
    # Sliding-window and full-attention layers share their parameters' shape: the window is
    # a per-layer input of the scan.
    windows = jnp.asarray([c.sliding_window if i in c.sliding_layers else 0 for i in run.layers], jnp.int32)
    moe = run.is_moe(c)
    if unrolled:  # layer i's experts as they rest on the device, and as the placement computes with them
        at_rest = lambda i: run_params[min(i, count - 1)]["moe"]["experts"]
        own = lambda i: placement.gather_experts(at_rest(i))
    else:
        stack = run_params["moe"]["experts"] if moe else None
        at_rest = lambda i: layer_slice(stack, jnp.minimum(i, count - 1))
        own = lambda i: placement.layer_experts(stack, i)
    depth = min(placement.prefetch_depth, count) if moe else 0
    gather = lambda i: placement.gather_experts(at_rest(i))
    ahead = tuple(gather(j) for j in range(depth))  # the first `depth` layers' experts, before the loop

    def body(carry, xs):
        # The run's cache rides in the carry and each layer updates its own slice in place (as
        # scanned inputs and outputs, XLA would keep two more copies of the whole cache).
        x, selected, ahead, run_cache = carry
        lp, i, window, layer_forced = xs
        layer_cache = layer_slice(run_cache, i)
        if not moe:
            experts = None
        elif depth:  # computed with weights gathered `depth` iterations ago; the next gather goes out now
            experts, ahead = ahead[0], ahead[1:] + (gather(i + depth),)
        else:
            experts = own(i)
        # `moejax trace` tells the MoE layers' ops from the dense layers' by this scope.
        with jax.named_scope("moe_layers" if moe else "dense_layers"):
            x, layer_cache, selected, ids = decoder_layer(lp, experts, x, positions, cos_sin, layer_cache, selected, c,
                                                          placement, window, layer_forced, pages)
        run_cache = jax.tree.map(lambda whole, new: jax.lax.dynamic_update_index_in_dim(whole, new, i, 0), run_cache,
                                 layer_cache)
        return (x, selected, ahead, run_cache), ids

    carry = (x, selected, ahead, run_cache)
    if unrolled:
        picks = []
        for i in range(count):
            carry, ids = body(carry, (run_params[i], i, windows[i], None if forced is None else forced[i]))
            picks.append(ids)
        picks = picks if moe else None
    else:
        carry, picks = jax.lax.scan(body, carry, (run_params, jnp.arange(count, dtype=jnp.int32), windows, forced))
    x, selected, _, run_cache = carry
    return x, run_cache, selected, picks


def forward(params: dict, cache: list, tokens: jax.Array, positions: jax.Array, c: ModelConfig, placement,
            forced=None, pages=None):
    """tokens, positions: [B, T] -> (hidden: [B, T, D] after the final norm, cache, picks).

    cache: per run of layers, contiguous arrays [layers, B, ...], or with `pages` (each request's
    block table, int32 [B, P]) page pools [layers, pages, ...] (`model/paged.py`).
    picks: one int32 [B*T, k] array per MoE layer (the router's choices, for recording).
    forced: int32 [MoE layers, B*T, k] picks replacing the router's (a routing override), or None.
    """
    x = placement.constrain(params["embed"][tokens], ROWS)
    cos_sin = rope_cos_sin(c, positions)
    b, t = tokens.shape
    # DSA: the selection a layer without an indexer reuses (layer 0 always has its own).
    seq = jax.tree.leaves(cache)[0].shape[-2] if pages is None else pages.shape[1] * paged.page_size_of(cache)
    selected = jnp.ones((b, t, seq), bool) if c.is_dsa else None
    new_cache, picks = [], []
    for run, run_params, run_cache in zip(layer_runs(c), params["layers"], cache):
        run_forced = None
        if forced is not None and run.is_moe(c):  # this MoE run's slice of the MoE layers
            run_forced, forced = forced[: run.count], forced[run.count:]
        x, run_cache, selected, run_picks = run_layers(run, run_params, run_cache, x, selected, positions, cos_sin, c,
                                                       placement, run_forced, pages)
        new_cache.append(run_cache)
        if run_picks is not None:
            picks.extend(run_picks)
    return rms_norm(x, params["final_norm"], c.rms_norm_eps), new_cache, picks


def lm_head(params: dict, h: jax.Array, c: ModelConfig) -> jax.Array:
    """h: [..., D] -> float32 logits [..., V]."""
    w = params["embed"].T if c.tie_word_embeddings else params["lm_head"]
    return (h @ w).astype(jnp.float32)


def layer_params(params: dict, layer: int, c: ModelConfig) -> dict:
    """Decoder layer `layer`'s parameters, out of its run's stack (or its run's tuple, unstacked)."""
    run_index, run = next((r, run) for r, run in enumerate(layer_runs(c)) if layer in run.layers)
    run_params = params["layers"][run_index]
    if isinstance(run_params, tuple):
        return run_params[layer - run.first]
    return jax.tree.map(lambda a: a[layer - run.first], run_params)


def unstack_layers(params: dict, unrolls) -> dict:
    """`params` with the stacked [layers, ...] tree of each run whose length `unrolls(layers)`
    as a tuple of per-layer trees (each layer's arrays its own buffers, placed as the stack was);
    `params` itself if no run changes."""
    count = lambda run: jax.tree.leaves(run)[0].shape[0]
    split = [not isinstance(run, tuple) and unrolls(count(run)) for run in params["layers"]]
    if not any(split):
        return params
    return {**params, "layers": [_layers_of(run) if cut else run for run, cut in zip(params["layers"], split)]}


@jax.jit
def _layers_of(run):
    """A run's stacked tree [layers, ...] -> a tuple of per-layer trees, in one program (eager
    slices would be a program per leaf shape for a start-up to compile or fetch)."""
    return tuple(layer_slice(run, i) for i in range(jax.tree.leaves(run)[0].shape[0]))
