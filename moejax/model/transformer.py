"""The decoder: embedding, layers (attention + dense MLP or MoE), final norm, LM head.

Layers run by runs of identical layers (`params.layer_runs`), one step body for every layer,
as the run's loop goes (`placement.loops`, `layer_loop.py`): one `lax.scan` over the stacked
parameters and cache, so compile time and memory do not grow with depth, or unrolled over
per-layer trees (XLA:CPU's short runs). A placement that moves expert weights to the rows
(`placement.prefetch_depth` > 0) has the loop carry the experts gathered for the next
`prefetch_depth` MoE layers: iteration i computes with weights gathered `prefetch_depth`
iterations earlier and issues the gather for layer i + depth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.config import ModelConfig
from moejax.model import layer_loop, paged, projections
from moejax.model.attention import attention
from moejax.model.layer_loop import cache_layer, with_cache_layer
from moejax.model.layers import rms_norm, rope_cos_sin
from moejax.model.moe import moe_block
from moejax.model.params import Run, layer_runs

ROWS = ("batch", "seq", "embed")


def decoder_layer(
    lp: dict,
    experts,
    x: jax.Array,
    positions,
    cos_sin,
    cache: dict,
    selected,
    c: ModelConfig,
    placement,
    window=0,
    forced=None,
    pages=None,
):
    """One layer (attention + dense MLP or MoE) on x: [B, T, D] -> (x, cache, selected, picks or None).
    `experts`: the MoE layer's expert weights as the placement computes with them; `selected`:
    the DSA selection of the layer before; `window`: its sliding window (0: full attention);
    `forced`: int32 [B*T, k] picks replacing the router's (None: the router's own); `pages`: the
    block table [B, P] of a paged cache (`paged.LayerPages`, or `paged.GroupPages` with page groups;
    None: contiguous)."""
    # Each block takes the residual stream and its norm's weight and returns the stream with its
    # output added: the norms, and the residual adds, are parts of its products (`projections`).
    with jax.named_scope("attention"):  # for `moejax trace`
        x, cache, selected = attention(
            lp["attn"], x, lp["attn_norm"], positions, cos_sin, cache, c, placement, selected, window, pages
        )
    x = placement.constrain(x, ROWS)
    ids = None
    if "moe" in lp:
        x, ids = moe_block(lp["moe"], experts, x, lp["mlp_norm"], c, placement, forced)
    else:
        x = projections.mlp(placement, lp["mlp"], rms_norm(x, lp["mlp_norm"], c.rms_norm_eps), x)
    return placement.constrain(x, ROWS), cache, selected, ids


def run_layers(
    run: Run,
    loop,
    run_params,
    run_cache: dict,
    x,
    selected,
    positions,
    cos_sin,
    c: ModelConfig,
    placement,
    forced=None,
    pages=None,
):
    """One run of identical layers: x: [B, T, D] -> (x, run_cache, selected, picks: int32
    [layers, B*T, k] of a MoE run (a list of [B*T, k] where unrolled), else None).
    `run_params`: the run's parameters as its `loop` (`layer_loop.Scan` or `Unrolled`) holds them;
    `forced`: a MoE run's int32 [layers, B*T, k] picks replacing the router's, or None."""
    count = run.count
    # Sliding-window and full-attention layers share their parameters' shape: the window is
    # a per-layer input of the scan.
    kinds = [i in c.sliding_layers for i in run.layers]
    windows = jnp.asarray([c.sliding_window if w else 0 for w in kinds], jnp.int32)
    # Page groups (`paged.Tables`): each layer's index in its own group's pools.
    groups = isinstance(pages, paged.Tables)
    index = [kinds[:i].count(w) for i, w in enumerate(kinds)]
    uniform = kinds[0] if len(set(kinds)) == 1 else None  # the run's one kind, else chosen per layer
    moe = run.is_moe(c)
    at_rest = loop.part(run_params, "moe", "experts") if moe else None  # the run's experts as they rest on the devices
    # The router kernel reads its norm and weight in the run's stacks: a scan's slice of one is a copy
    # for a kernel's operand (`projections.route` slices them for XLA's router).
    in_place = moe and placement.decode.router is not None
    norms, routers = (
        (loop.part(run_params, "mlp_norm"), loop.part(run_params, "moe", "router")) if in_place else (None, None)
    )
    # So does a dense kernel reading its weights in their stacks (a TPU's): attention's q|k|v and output
    # projection, their norms and biases (`projections.qkv`, `projections.out` slice them for XLA's ops).
    decode = placement.decode
    attn_in_place = not c.is_mla and "attention" in decode.dense and decode.linear_reads_stacks
    attn = (loop.part(run_params, "attn_norm"), loop.part(run_params, "attn")) if attn_in_place else None
    depth = min(placement.prefetch_depth, count) if moe else 0
    gather = lambda i: placement.gather_experts(loop.layer(at_rest, i))
    ahead = tuple(gather(j) for j in range(depth))  # the first `depth` layers' experts, before the loop

    def layer_pages(i, window):
        if pages is None:
            return None
        if not groups:
            return paged.LayerPages(pages, i)
        if isinstance(i, int):  # unrolled: the kind is known
            return paged.GroupPages(pages, index[i], kinds[i])
        kind = uniform if uniform is not None else window > 0
        return paged.GroupPages(pages, jnp.asarray(index, jnp.int32)[i], kind)

    def body(carry, xs):
        # The run's cache rides in the carry and each layer updates its own slice in place (as
        # scanned inputs and outputs, XLA would keep two more copies of the whole cache). Page
        # pools are read and written whole through the layer's index (`paged.LayerPages`).
        x, selected, ahead, run_cache = carry
        lp, i, window, layer_forced = xs
        if in_place:
            lp = {**lp, "mlp_norm": loop.in_place(norms, i), "moe": {**lp["moe"], "router": loop.in_place(routers, i)}}
        if attn_in_place:
            weights = loop.in_place(attn[1], i)
            weights = {k: w for k, w in weights.items() if k in projections.ATTENTION_WEIGHTS}
            lp = {**lp, "attn_norm": loop.in_place(attn[0], i), "attn": {**lp["attn"], **weights}}
        layer_cache = run_cache if pages is not None else cache_layer(run_cache, i)
        if not moe:
            experts = None
        elif depth:  # computed with weights gathered `depth` iterations ago; the next gather goes out now
            experts, ahead = ahead[0], ahead[1:] + (gather(i + depth),)
        else:
            experts = loop.experts(placement, at_rest, i)
        # `moejax trace` tells the MoE layers' ops from the dense layers' by this scope.
        with jax.named_scope("moe_layers" if moe else "dense_layers"):
            x, layer_cache, selected, ids = decoder_layer(
                lp,
                experts,
                x,
                positions,
                cos_sin,
                layer_cache,
                selected,
                c,
                placement,
                window,
                layer_forced,
                layer_pages(i, window),
            )
        run_cache = layer_cache if pages is not None else with_cache_layer(run_cache, i, layer_cache)
        return (x, selected, ahead, run_cache), ids

    (x, selected, _, run_cache), picks = loop.loop(body, (x, selected, ahead, run_cache), run_params, windows, forced)
    return x, run_cache, selected, picks if moe else None


def forward(
    params: dict,
    cache: list,
    tokens: jax.Array,
    positions: jax.Array,
    c: ModelConfig,
    placement,
    forced=None,
    pages=None,
):
    """tokens, positions: [B, T] -> (hidden: [B, T, D] after the final norm, cache, picks).

    cache: per run of layers, contiguous arrays [layers, B, ...], or with `pages` (each request's
    block table, int32 [B, P]) page pools [layers, pages, ...] (`model/paged.py`).
    picks: one int32 [B*T, k] array per MoE layer (the router's choices, for recording).
    forced: int32 [MoE layers, B*T, k] picks replacing the router's (a routing override), or None.
    """
    x = placement.constrain(params["embed"][tokens], ROWS)
    # Computed once a step: the TPU compiler sinks the sin and cos into a layer loop that reads them
    # (a fusion a layer), where they stay outside the barrier.
    cos_sin = jax.lax.optimization_barrier(rope_cos_sin(c, positions))
    b, t = tokens.shape
    # DSA: the selection a layer without an indexer reuses (layer 0 always has its own).
    seq = jax.tree.leaves(cache)[0].shape[-2] if pages is None else paged.width(pages) * paged.page_size_of(cache)
    selected = jnp.ones((b, t, seq), bool) if c.is_dsa else None
    new_cache, picks = [], []
    for run, loop, run_params, run_cache in zip(layer_runs(c), placement.loops, params["layers"], cache):
        run_forced = None
        if forced is not None and run.is_moe(c):  # this MoE run's slice of the MoE layers
            run_forced, forced = forced[: run.count], forced[run.count :]
        x, run_cache, selected, run_picks = run_layers(
            run, loop, run_params, run_cache, x, selected, positions, cos_sin, c, placement, run_forced, pages
        )
        new_cache.append(run_cache)
        if run_picks is not None:
            picks.extend(run_picks)
    return rms_norm(x, params["final_norm"], c.rms_norm_eps), new_cache, picks


def lm_head(params: dict, h: jax.Array, c: ModelConfig) -> jax.Array:
    """h: [..., D] -> float32 logits [..., V]."""
    w = params["embed"].T if c.tie_word_embeddings else params["lm_head"]
    return (h @ w).astype(jnp.float32)


def layer_params(params: dict, layer: int, c: ModelConfig, loops: tuple | None = None) -> dict:
    """Decoder layer `layer`'s parameters, out of its run as `loops` hold the runs (default:
    stacked, as loaded; an engine's: `engine.loops`)."""
    run_index, run = next((r, run) for r, run in enumerate(layer_runs(c)) if layer in run.layers)
    loop = (loops or layer_loop.stacked(c))[run_index]
    return loop.layer(params["layers"][run_index], layer - run.first)
