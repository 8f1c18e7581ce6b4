"""Token choice from logits: greedy, or temperature with optional top-k and top-p.

`Sampling` is static under jit (greedy compiles to an argmax without a vocabulary sort).
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


def sample(logits: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """logits: float32 [B, V] -> token ids int32 [B]."""
    if s.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, sampling_logits(logits, s), axis=-1).astype(jnp.int32)


def sampling_logits(logits: jax.Array, s: Sampling) -> jax.Array:
    """The logits `sample` draws from (temperature, top-k, top-p applied; -inf = excluded):
    softmax of them is the sampling distribution (speculative acceptance needs it)."""
    logits = logits / s.temperature
    if s.top_k:
        kth = jax.lax.top_k(logits, s.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep the smallest set of tokens whose mass reaches top_p (the first token always stays).
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(mass_before < s.top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits
