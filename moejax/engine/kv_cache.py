"""The preallocated KV cache: per run of identical layers (`params.layer_runs`), one dict of
arrays stacked on a leading layers axis, [layers, B, ...]."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from moejax.config import ModelConfig
from moejax.model.attention import cache_specs
from moejax.model.params import layer_runs


def init_cache(c: ModelConfig, batch: int, max_len: int, dtype) -> list[dict]:
    return [
        {k: jnp.zeros((run.count, *shape), dtype) for k, (shape, _) in cache_specs(c, batch, max_len, run.first).items()}
        for run in layer_runs(c)
    ]


def _seq_axes(c: ModelConfig, cache: list[dict]) -> list[dict]:
    """Per run and entry, the axis of cache positions in its [layers, B, ...] array."""
    return [{k: 1 + axes.index("cache_seq") for k, (_, axes) in cache_specs(c, 1, 1, run.first).items() if k in entries}
            for run, entries in zip(layer_runs(c), cache)]


def leading(c: ModelConfig, cache: list[dict], length: int) -> list[dict]:
    """The cache's first `length` positions (a copy): what a prefill chunk ending by then sees."""
    return [{k: lax.slice_in_dim(a, 0, length, axis=axes[k]) for k, a in run.items()}
            for run, axes in zip(cache, _seq_axes(c, cache))]


def put_leading(c: ModelConfig, cache: list[dict], part: list[dict]) -> list[dict]:
    """`cache` with its first positions replaced by `part` (from `leading`), in place when donated."""
    return [{k: lax.dynamic_update_slice_in_dim(a, part_run[k], 0, axis=axes[k]) for k, a in run.items()}
            for run, part_run, axes in zip(cache, part, _seq_axes(c, cache))]
