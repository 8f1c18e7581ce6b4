"""The preallocated KV cache: per run of identical layers (`params.layer_runs`), one dict of
arrays stacked on a leading layers axis, [layers, B, ...]."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.config import ModelConfig
from moejax.model.attention import cache_specs
from moejax.model.params import layer_runs


def init_cache(c: ModelConfig, batch: int, max_len: int, dtype) -> list[dict]:
    return [
        {k: jnp.zeros((run.count, *shape), dtype) for k, (shape, _) in cache_specs(c, batch, max_len, run.first).items()}
        for run in layer_runs(c)
    ]


def cache_bytes(cache: list[dict]) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(cache))
