"""The preallocated KV cache: per run of identical layers (`params.layer_runs`), one dict of
arrays stacked on a leading layers axis: contiguous rows [layers, B, ...], or page pools
[layers, pages, ...] that block tables index (`model/paged.py`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from moejax.config import ModelConfig
from moejax.model import paged
from moejax.model.attention import cache_specs
from moejax.model.layer_loop import split_layers, stack_layers
from moejax.model.params import layer_runs
from pallas_kernels.paged_attention import combined, head_dim


def per_layer(cache: list[dict], loops: tuple, apart: bool) -> list:
    """A contiguous cache with each unrolled run's entries as a tuple of per-layer dicts, each
    layer's arrays their own buffers: a decoder layer reads and writes its own in place, where a
    layer sliced out of the run's [layers, ...] and put back is two copies of it per step on
    XLA:CPU. A program of several decode steps splits once and `restack`s once. Only where
    `apart` (`Platform.buffers_apart`: XLA:CPU): on a GPU the split buffers are a second whole cache
    for the program (`tests/test_target_structure.py`), and the run keeps its stack."""
    if not apart:
        return cache
    return [run if loop.stacked else split_layers(run) for run, loop in zip(cache, loops)]


def restack(cache: list) -> list[dict]:
    """`per_layer`'s cache back as [layers, ...] per run."""
    return [stack_layers(run) if isinstance(run, tuple) else run for run in cache]


def init_cache(c: ModelConfig, batch: int, max_len: int, dtype) -> list[dict]:
    return [
        {
            k: jnp.zeros((run.count, *shape), dtype)
            for k, (shape, _) in cache_specs(c, batch, max_len, run.first).items()
        }
        for run in layer_runs(c)
    ]


def pool_specs(
    c: ModelConfig, pages: int, page_size: int, dtype, layer: int | None = None, kernel: str = "xla"
) -> dict:
    """`cache_specs` of a pool in `dtype`: name -> ([pages, ..., page_size, ...], logical axes);
    GQA's k and v interleaved in one pool where the paged-attention `kernel` reads that
    (`paged.kv_pool_spec`), and as wide as the kernel reads a head in `dtype` (`head_dim`)."""
    if c.is_mla:
        return {
            k: paged.pool_spec(shape, axes, pages, page_size)
            for k, (shape, axes) in cache_specs(c, 1, 1, layer).items()
        }
    if combined(kernel):
        return paged.kv_pool_spec(c, pages, page_size, kernel, dtype)
    return {
        k: paged.pool_spec(shape, axes, pages, page_size, head_dim(kernel, c.head_dim, dtype))
        for k, (shape, axes) in cache_specs(c, 1, 1, layer).items()
    }


def group_counts(c: ModelConfig, run) -> tuple[int, int]:
    """(full-attention layers, sliding-window layers) of a run: each group's pools' layers."""
    window = sum(i in c.sliding_layers for i in run.layers)
    return run.count - window, window


def init_pool(
    c: ModelConfig, pages: int, page_size: int, dtype, kernel: str = "xla", window_pages: int = 0
) -> list[dict]:
    """Per run, its full-attention layers' pools [layers, pages, ...] and, for a model with
    sliding-window layers, theirs [layers, window_pages, ...] (entries `paged.WINDOW` + name)."""
    out = []
    for run in layer_runs(c):
        full, window = group_counts(c, run)
        pools = (
            {
                k: jnp.zeros((full, *shape), dtype)
                for k, (shape, _) in pool_specs(c, pages, page_size, dtype, run.first, kernel).items()
            }
            if full
            else {}
        )
        if window:
            pools |= {
                paged.WINDOW + k: jnp.zeros((window, *shape), dtype)
                for k, (shape, _) in pool_specs(c, window_pages, page_size, dtype, run.first, kernel).items()
            }
        out.append(pools)
    return out


def page_bytes(
    c: ModelConfig, page_size: int, dtype, kernel: str = "xla", mtp: bool = False, window: bool | None = None
) -> int:
    """Bytes one page holds over every layer and entry; `mtp`: and the MTP layer's own pool's
    page (MTP drafts, `model/mtp.py`: the XLA layout, an indexer of its own). `window` False:
    a page of the full-attention layers' group only (with `mtp`, and its page); True: of the
    sliding-window layers' (their own page group, `init_pool`)."""
    size = jnp.dtype(dtype).itemsize
    count = lambda run: run.count if window is None else group_counts(c, run)[int(window)]
    runs = [(count(run), pool_specs(c, 1, page_size, dtype, run.first, kernel)) for run in layer_runs(c)]
    runs += [(1, pool_specs(c, 1, page_size, dtype, c.num_layers))] if mtp and not window else []
    return sum(count * size * int(np.prod(shape)) for count, specs in runs for shape, _ in specs.values())


def _seq_axes(c: ModelConfig, cache: list[dict]) -> list[dict]:
    """Per run and entry, the axis of cache positions in its [layers, B, ...] array."""
    return [
        {k: 1 + axes.index("cache_seq") for k, (_, axes) in cache_specs(c, 1, 1, run.first).items() if k in entries}
        for run, entries in zip(layer_runs(c), cache)
    ]


def leading(c: ModelConfig, cache: list[dict], length: int) -> list[dict]:
    """The cache's first `length` positions (a copy): what a prefill chunk ending by then sees."""
    return [
        {k: lax.slice_in_dim(a, 0, length, axis=axes[k]) for k, a in run.items()}
        for run, axes in zip(cache, _seq_axes(c, cache))
    ]


def put_leading(c: ModelConfig, cache: list[dict], part: list[dict]) -> list[dict]:
    """`cache` with its first positions replaced by `part` (from `leading`), in place when donated."""
    return [
        {k: lax.dynamic_update_slice_in_dim(a, part_run[k], 0, axis=axes[k]) for k, a in run.items()}
        for run, part_run, axes in zip(cache, part, _seq_axes(c, cache))
    ]
