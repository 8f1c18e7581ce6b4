"""The preallocated KV cache: one dict of arrays per layer, shaped [B, S, ...]."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.config import ModelConfig
from moejax.model.attention import cache_specs


def cache_axes(c: ModelConfig, batch: int, max_len: int) -> list[dict]:
    """Logical axes of every cache array (for the placements' shardings)."""
    return [{k: axes for k, (_, axes) in cache_specs(c, batch, max_len, i).items()} for i in range(c.num_layers)]


def init_cache(c: ModelConfig, batch: int, max_len: int, dtype) -> list[dict]:
    return [
        {k: jnp.zeros(shape, dtype) for k, (shape, _) in cache_specs(c, batch, max_len, i).items()}
        for i in range(c.num_layers)
    ]


def cache_bytes(cache: list[dict]) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(cache))
