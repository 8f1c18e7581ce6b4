"""The scheduler's device programs: one decode step over the first W slots and one prefill chunk
into P slots of the one KV cache [slots, max_len], and the gathers/scatters of slot rows and
positions they and the prefill hand-over use. Pure functions, jitted by `scheduler.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.engine.logprobs import biased, logprobs_of
from moejax.engine.sampling import sample_rows
from moejax.model.transformer import forward, lm_head


# The batch axis of a cache array: 1 in a run's stacked [layers, B, ...] cache, 0 in the MTP
# layer's own [B, ...] cache.
RUN_BATCH_AXIS = 1


def take_rows(cache: list[dict], slots: jax.Array, axis: int = RUN_BATCH_AXIS) -> list[dict]:
    """The cache rows of `slots` [W] (slot S, out of range: zeros)."""
    at = (slice(None),) * axis + (slots,)
    return [{k: v.at[at].get(mode="fill", fill_value=0) for k, v in layer.items()} for layer in cache]


def put_rows(cache: list[dict], slots: jax.Array, rows: list[dict], axis: int = RUN_BATCH_AXIS) -> list[dict]:
    """cache with `rows` written back at `slots` (slot S: dropped). A gather/scatter at traced slot
    ids: with static slices XLA folds the read into the write-back and copies the whole cache twice
    a step instead of updating it in place."""
    at = (slice(None),) * axis + (slots,)
    return [{k: v.at[at].set(r[k], mode="drop") for k, v in layer.items()} for layer, r in zip(cache, rows)]


def _positions_index(ndim: int, seq: int, slots: jax.Array, positions: jax.Array) -> tuple:
    """Index of a run's cache array [layers, B, ..., S at axis seq, ...] at the positions [P, C]
    of `slots` [P]."""
    index = [slice(None)] * ndim
    index[RUN_BATCH_AXIS], index[seq] = slots[:, None], positions
    return tuple(index)


def take_positions(cache: list[dict], slots: jax.Array, positions: jax.Array, seq_axes: list[dict]) -> list[dict]:
    """The entries at `positions` [P, C] of `slots` [P] (out of range: zeros), each array laid out
    as the cache with P rows of C positions. (Index arrays apart put their axes first: moved back.)"""
    def take(v, seq):
        piece = v.at[_positions_index(v.ndim, seq, slots, positions)].get(mode="fill", fill_value=0)
        return piece if seq == RUN_BATCH_AXIS + 1 else jnp.moveaxis(piece, (0, 1), (RUN_BATCH_AXIS, seq))
    return [{k: take(v, axes[k]) for k, v in layer.items()} for layer, axes in zip(cache, seq_axes)]


def put_positions(cache: list[dict], slots: jax.Array, positions: jax.Array, pieces: list[dict],
                  seq_axes: list[dict]) -> list[dict]:
    """cache with `take_positions`' pieces written back at `positions` of `slots` (out of range: dropped)."""
    def put(v, piece, seq):
        piece = piece if seq == RUN_BATCH_AXIS + 1 else jnp.moveaxis(piece, (RUN_BATCH_AXIS, seq), (0, 1))
        return v.at[_positions_index(v.ndim, seq, slots, positions)].set(piece, mode="drop")
    return [{k: put(v, piece[k], axes[k]) for k, v in layer.items()} for layer, piece, axes in zip(cache, pieces, seq_axes)]


def choose(logits, sampling: dict, positions, *, greedy_only: bool, extras: bool):
    """The rows' next tokens from logits [B, V] -> (tokens [B], logprobs dict or {}). extras
    (static): apply sampling["bias_ids"/"bias"] [B, K] (logit_bias, min_tokens) and report the
    model's own logprobs of the tokens chosen."""
    raw = logits
    if extras:
        logits = biased(logits, sampling["bias_ids"], sampling["bias"])
    token = sample_rows(logits, sampling["temperature"], sampling["top_p"], sampling["top_k"], sampling["seeds"],
                        positions, greedy_only=greedy_only)
    return token, logprobs_of(raw, token) if extras else {}


def decode_slots(params, cache, slots, tokens, positions, sampling, forced=None, *, c, placement, greedy_only,
                 extras):
    """One decode step over the first W slots (`slots` = 0..W-1): tokens, positions: [W];
    sampling: `choose`'s per-row arrays -> (next tokens [W], their logprobs, cache, picks);
    forced: a routing override's int32 [MoE layers, W, k] picks, or None."""
    every = slots.shape[0] == cache[0][next(iter(cache[0]))].shape[RUN_BATCH_AXIS]  # all slots: no gather needed
    h, rows, picks = forward(params, cache if every else take_rows(cache, slots), tokens[:, None], positions[:, None],
                             c, placement, forced)
    token, lp = choose(lm_head(params, h[:, 0], c), sampling, positions + 1, greedy_only=greedy_only, extras=extras)
    return token, lp, rows if every else put_rows(cache, slots, rows), picks


def prefill_slots(params, cache, slots, tokens, start, last, after, sampling, forced=None, *, c, placement,
                  greedy_only, extras, prompt_logprobs):
    """One prefill chunk of P requests into their slots: slots, start, last: [P], tokens: [P, C];
    after: [P] the prompt token following the chunk (read for prompt_logprobs only).
    A padding row names slot S (out of range): it reads zeros and its writes are dropped.
    forced: a routing override's int32 [MoE layers, P*C, k] picks, or None.
    Returns (the token after `last` per row [P], meaningful where `last` is in this chunk; its
    logprobs, with prompt_logprobs (static) also "prompt": each position's logprobs of the prompt
    token after it [P, C]; the logits at `last` [P, V]; cache; picks)."""
    p, chunk = tokens.shape
    positions = start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    h, rows, picks = forward(params, take_rows(cache, slots), tokens, positions, c, placement, forced)
    logits = lm_head(params, h[jnp.arange(p), jnp.clip(last - start, 0, chunk - 1)], c)
    token, lp = choose(logits, sampling, last + 1, greedy_only=greedy_only, extras=extras)
    if prompt_logprobs:
        following = jnp.concatenate([tokens[:, 1:], after[:, None]], axis=1)  # [P, C]
        lp = {**lp, "prompt": logprobs_of(lm_head(params, h, c), following)}
    return token, lp, logits, put_rows(cache, slots, rows), picks


def fork_slots(cache, source, slots, logits, sampling, positions):
    """n samples of one prompt, prefilled once: the cache row of slot `source` [1] copied into
    `slots` [F] (slot S: padding, dropped), and each one's first token drawn from the source's
    logits at the prompt's last position [V] with its own seed -> (tokens [F], logprobs, cache)."""
    rows = take_rows(cache, jnp.broadcast_to(source, slots.shape))
    logits = jnp.broadcast_to(logits, (slots.shape[0], logits.shape[-1]))
    token, lp = choose(logits, sampling, positions, greedy_only=False, extras=True)
    return token, lp, put_rows(cache, slots, rows)
