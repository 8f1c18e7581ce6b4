"""The engine's step functions, pure and jit-compiled (`programs.py`): a prefill chunk, a decode
step, and a block of decode steps in one program.

State is explicit: (params, KV cache) go in, the new cache comes out, and the cache buffer is
donated so that a step updates it in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from moejax.config import ModelConfig
from moejax.engine.kv_cache import leading, per_layer, put_leading, restack
from moejax.engine.pages import pages_for
from moejax.engine.sampling import Sampling, sample
from moejax.model import paged
from moejax.model.transformer import forward, lm_head


def prefill(
    params,
    cache,
    tokens,
    start,
    last,
    forced=None,
    pages=None,
    *,
    c: ModelConfig,
    placement,
    all_logits: bool,
    record: bool,
    visible: int = 0,
):
    """One prefill chunk. tokens: [B, C] at positions start..start+C-1; last: [B] each request's
    last prompt position; forced: int32 [MoE layers, B*C, k] picks of a routing override, or None;
    visible (static): the chunk ends by this position, so attention reads only the cache's first
    `visible` positions (0: all of them); pages: the block table [B, P] of a paged cache, or None
    (its first pages holding `visible` positions are all a chunk reads). Returns (logits:
    [B, C, V] if all_logits else [B, V] at `last` when it falls in this chunk, cache, picks or None)."""
    b, chunk = tokens.shape
    positions = start + jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
    if pages is not None:
        if visible:
            pages = paged.narrow(pages, pages_for(visible, paged.page_size_of(cache)))
        h, cache, picks = forward(params, cache, tokens, positions, c, placement, forced, pages)
    elif visible:
        h, seen, picks = forward(params, leading(c, cache, visible), tokens, positions, c, placement, forced)
        cache = put_leading(c, cache, seen)
    else:
        h, cache, picks = forward(params, cache, tokens, positions, c, placement, forced)
    if not all_logits:
        h = h[jnp.arange(b), jnp.clip(last - start, 0, chunk - 1)]
    return lm_head(params, h, c), cache, picks if record else None


def decode_step(
    params,
    cache,
    tokens,
    lens,
    seeds,
    step,
    forced=None,
    pages=None,
    *,
    c: ModelConfig,
    placement,
    sampling: Sampling,
    record: bool,
):
    """Decode step `step` (1: the first after the prompt): tokens [B] go to positions lens + step - 1
    (lens: [B] prompt lengths) -> (next tokens [B], logits [B, V], cache, picks), each row's drawn
    with its seed [B] at its position. forced: int32 [MoE layers, B, k] picks of a routing override,
    or None (two compiled variants); pages: a paged cache's block table [B, P], or None. The
    positions are made here, not by the host between steps: as eager ops they would be programs
    of their own, dispatched every step."""
    positions = lens + (step - 1)
    h, cache, picks = forward(params, cache, tokens[:, None], positions[:, None], c, placement, forced, pages)
    logits = lm_head(params, h[:, 0], c)
    return sample(logits, sampling, seeds, positions + 1), logits, cache, picks if record else None


def decode_steps(
    params,
    cache,
    tokens,
    lens,
    seeds,
    first,
    count,
    pages=None,
    *,
    block: int,
    c: ModelConfig,
    placement,
    sampling: Sampling,
    visible: int = 0,
):
    """Decode steps first .. first + count - 1 (count <= block), each a `decode_step`, in one
    program -> (their tokens [block, B], rows past count zero; the last tokens [B]; cache).
    A program per step leaves the devices waiting on the host between steps, and each other
    in the step's first collective. visible (static): with a contiguous cache, the steps write
    and attend to its first `visible` positions only (0: all of them).

    The loop runs all `block` steps: a trip count known when compiling, where an accelerator's
    runtime reads a loop's condition computed on the device back to the host every iteration.
    A step past count changes nothing read later: it keeps no token, and its positions lie past
    the cache's end (past every row's block table), where writes are dropped."""
    if pages is None:  # a contiguous cache: the positions the block sees, each unrolled layer's its own buffers
        carried = per_layer(
            leading(c, cache, visible) if visible else cache, placement.loops, placement.platform.buffers_apart
        )
        length = jax.tree.leaves(carried)[0].shape[-2]  # every contiguous entry's positions precede one last axis
    else:
        carried, length = cache, paged.width(pages) * paged.page_size_of(cache)

    def step(i, carry):
        tok, cache, out = carry
        live = i < count
        # A step past count at step length + 1: its positions are >= lens + length, past the cache.
        new, _, cache, _ = decode_step(
            params,
            cache,
            tok,
            lens,
            seeds,
            jnp.where(live, first + i, length + 1),
            pages=pages,
            c=c,
            placement=placement,
            sampling=sampling,
            record=False,
        )
        return jnp.where(live, new, tok), cache, out.at[i].set(jnp.where(live, new, 0))

    out = jnp.zeros((block, tokens.shape[0]), tokens.dtype)
    tok, carried, out = lax.fori_loop(0, block, step, (tokens, carried, out))
    if pages is not None:
        return out, tok, carried
    return out, tok, put_leading(c, cache, restack(carried))
