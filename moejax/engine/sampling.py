"""Token choice from logits, one sampler for every entry point (generate, serve and bench, MTP).

Each row has its own temperature / top-k / top-p and is drawn with a key made from its seed and
the position of the token drawn, so a request's tokens are a function of (model, prompt, sampling
parameters, seed) only: never of its slot, its batch neighbours, the batch size or the entry point.
`Sampling` is the static form for a batch of one setting (greedy compiles to an argmax without a
vocabulary sort).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """A key per row [B] from its seed [B] and the position [B] of the token it draws."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(jax.random.key(0), s), p))(seeds, positions)


def masked_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits [B, V] with per-row temperature, top_k (0: off), top_p [B] applied (-inf = excluded):
    softmax of them is the sampling distribution. One descending sort serves both cuts."""
    logits = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    desc = -jnp.sort(-logits, axis=-1)  # [B, V]
    rank = jnp.arange(logits.shape[-1])[None, :]
    in_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    desc = jnp.where(in_k, desc, -jnp.inf)
    kth = jnp.min(jnp.where(in_k, desc, jnp.inf), axis=-1, keepdims=True)
    probs = jax.nn.softmax(desc, axis=-1)
    # Keep the smallest set of tokens whose mass reaches top_p (the best token always stays).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    cutoff = jnp.min(jnp.where(mass_before < top_p[:, None], desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < jnp.maximum(kth, cutoff), -jnp.inf, logits)


def draw(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One categorical draw per row: keys [B], logits [B, V] -> int32 [B]."""
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def sample_rows(logits, temperature, top_p, top_k, seeds, positions, *, greedy_only: bool) -> jax.Array:
    """logits [B, V], per-row temperature / top_p / top_k / seed and the position drawn [B] -> [B]
    (temperature 0: the argmax). greedy_only (static): every row greedy, no sort compiled."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy_only:
        return greedy
    drawn = draw(row_keys(seeds, positions), masked_logits(logits, temperature, top_k, top_p))
    return jnp.where(temperature > 0, drawn, greedy)


def _rows(s: Sampling, b: int) -> dict:
    return dict(
        temperature=jnp.full((b,), s.temperature, jnp.float32),
        top_k=jnp.full((b,), s.top_k, jnp.int32),
        top_p=jnp.full((b,), s.top_p, jnp.float32),
    )


def sample(logits: jax.Array, s: Sampling, seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """logits float32 [B, V], the rows' seeds and drawn positions [B] -> token ids int32 [B]."""
    return sample_rows(logits, seeds=seeds, positions=positions, greedy_only=s.greedy, **_rows(s, logits.shape[0]))


def sampling_logits(logits: jax.Array, s: Sampling) -> jax.Array:
    """The logits `sample` draws from under `s` (speculative acceptance needs the distribution)."""
    return masked_logits(logits, **_rows(s, logits.shape[0]))
