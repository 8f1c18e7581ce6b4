"""The scheduler's device programs over the paged KV cache: one decode step over W rows and one
prefill chunk of P requests, each through its rows' block tables [rows, P] (`model/paged.py`),
the fork of n samples (pages copied), and the take/put of whole pages the prefill hand-over uses.
Pure functions, jitted by `scheduler.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.engine.logprobs import biased, logprobs_of
from moejax.engine.sampling import sample_rows
from moejax.model import paged
from moejax.model.transformer import forward, lm_head


def take_pages(cache: list[dict], ids: jax.Array) -> list[dict]:
    """The pages `ids` [K] (`paged.Tables` of them with page groups) of page pools
    [layers, pages, ...] -> [layers, K, ...] (id N: zeros)."""
    return [{k: v.at[:, paged.ids_for(ids, k)].get(mode="fill", fill_value=0) for k, v in run.items()} for run in cache]


def put_pages(cache: list[dict], ids: jax.Array, pieces: list[dict]) -> list[dict]:
    """Pools with `take_pages`' pieces written back at `ids` (id N: dropped)."""
    return [
        {k: v.at[:, paged.ids_for(ids, k)].set(piece[k], mode="drop") for k, v in run.items()}
        for run, piece in zip(cache, pieces)
    ]


def choose(logits, sampling: dict, positions, *, greedy_only: bool, extras: bool):
    """The rows' next tokens from logits [B, V] -> (tokens [B], logprobs dict or {}). extras
    (static): apply sampling["bias_ids"/"bias"] [B, K] (logit_bias, min_tokens) and report the
    model's own logprobs of the tokens chosen."""
    raw = logits
    if extras:
        logits = biased(logits, sampling["bias_ids"], sampling["bias"])
    token = sample_rows(
        logits,
        sampling["temperature"],
        sampling["top_p"],
        sampling["top_k"],
        sampling["seeds"],
        positions,
        greedy_only=greedy_only,
    )
    return token, logprobs_of(raw, token) if extras else {}


def decode_slots(params, cache, pages, tokens, positions, sampling, forced=None, *, c, placement, greedy_only, extras):
    """One decode step over W rows of page pools: pages: their block tables [W, P] (an idle row
    names no page: its writes are dropped), tokens, positions: [W]; sampling: `choose`'s per-row
    arrays -> (next tokens [W], their logprobs, cache, picks); forced: a routing override's int32
    [MoE layers, W, k] picks, or None."""
    h, cache, picks = forward(params, cache, tokens[:, None], positions[:, None], c, placement, forced, pages)
    token, lp = choose(lm_head(params, h[:, 0], c), sampling, positions + 1, greedy_only=greedy_only, extras=extras)
    return token, lp, cache, picks


def prefill_slots(
    params,
    cache,
    pages,
    tokens,
    start,
    last,
    after,
    sampling,
    forced=None,
    *,
    c,
    placement,
    greedy_only,
    extras,
    prompt_logprobs,
):
    """One prefill chunk of P requests into their pages: pages: block tables [P, K]; start, last:
    [P], tokens: [P, C]; after: [P] the prompt token following the chunk (read for
    prompt_logprobs only). A padding row names no page: it reads zeros and writes nothing.
    forced: a routing override's int32 [MoE layers, P*C, k] picks, or None.
    Returns (the token after `last` per row [P], meaningful where `last` is in this chunk; its
    logprobs, with prompt_logprobs (static) also "prompt": each position's logprobs of the prompt
    token after it [P, C]; the logits at `last` [P, V]; cache; picks)."""
    p, chunk = tokens.shape
    positions = start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    h, cache, picks = forward(params, cache, tokens, positions, c, placement, forced, pages)
    logits = lm_head(params, h[jnp.arange(p), jnp.clip(last - start, 0, chunk - 1)], c)
    token, lp = choose(logits, sampling, last + 1, greedy_only=greedy_only, extras=extras)
    if prompt_logprobs:
        following = jnp.concatenate([tokens[:, 1:], after[:, None]], axis=1)  # [P, C]
        lp = {**lp, "prompt": logprobs_of(lm_head(params, h, c), following)}
    return token, lp, logits, cache, picks


def fork_slots(cache, source, target, logits, sampling, positions, *, placement):
    """n samples of one prompt, prefilled once: the pages `source` [F] copied into `target` [F]
    (each sample's copy of the prompt's partly written last page, on the prompt's rank; id N:
    none, dropped; `paged.Tables` of ids with page groups), and each one's first token drawn from the prompt's logits
    at its last
    position [V] with its own seed -> (tokens [F], logprobs, cache)."""
    cache = placement.copy_pages(cache, source, target)
    logits = jnp.broadcast_to(logits, (jax.tree.leaves(target)[0].shape[0], logits.shape[-1]))
    token, lp = choose(logits, sampling, positions, greedy_only=False, extras=True)
    return token, lp, cache
