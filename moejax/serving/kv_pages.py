"""A scheduler's KV pages on the host: the pool's size, who holds each page (a count: n samples
of a prompt and prefix-cache hits share pages), each request's pages at admission (those of a
cached prefix, then fresh ones), the block tables its programs read, and the prefix cache. The
pool's arrays live on the devices; the scheduler owns them (`scheduler.py`)."""

from __future__ import annotations

import math

import jax
import numpy as np

from moejax import platform
from moejax.engine.engine import bucket
from moejax.engine.kv_cache import page_bytes
from moejax.engine.pages import PageAllocator, pages_for
from moejax.errors import UsageError
from moejax.serving.prefix_cache import PrefixCache

PAGE_SIZE = 16  # positions per page (--page-size)
# Block-table widths a program compiles for: this many positions, x4, x16, ... and the longest
# request's (a narrower read saves less than another set of programs costs to compile).
MIN_TABLE_POSITIONS = 128
TABLE_STEP = 4


def pool_pages(engine, page_size: int, kv_tokens: int = 0, kv_gb: float = 0.0, multiple: int = 1) -> int:
    """Pages of the pool: `kv_tokens` positions, or `kv_gb` GB, or the platform's default
    (`platform.kv_cache_bytes`), rounded up to a multiple of `multiple` (with DP attention each
    rank holds an equal share)."""
    if page_size < 1 or kv_tokens < 0 or kv_gb < 0:
        raise UsageError(f"--page-size {page_size}, --kv-cache-tokens {kv_tokens} and --kv-cache-gb {kv_gb} "
                         f"must be positive")
    if kv_tokens and kv_gb:
        raise UsageError("give --kv-cache-tokens or --kv-cache-gb, not both")
    # The pool's layout is the attention kernel's (the TPU kernel's pads head_dim to 128 lanes).
    per_page = page_bytes(engine.c, page_size, engine.dtype, engine.placement.attention_kernel)
    if kv_tokens:
        pages = pages_for(kv_tokens, page_size)
    else:
        size = kv_gb * 1e9 or platform.kv_cache_bytes(list(jax.tree.leaves(engine.params)[0].devices()))
        pages = int(size // per_page) if size else pages_for(platform.CPU_KV_CACHE_TOKENS, page_size)
        if size and not kv_gb and jax.process_count() > 1:  # each read its own free memory: all take the least
            from jax.experimental import multihost_utils

            pages = int(multihost_utils.process_allgather(np.int64(pages)).min())
    return max(multiple, -(-pages // multiple) * multiple)


class KVPages:
    def __init__(self, num_pages: int, page_size: int, max_len: int, prefix_cache: bool):
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages, page_size)
        self.refs = np.zeros(num_pages, np.int32)  # requests holding each page
        self.prefix = PrefixCache(page_size) if prefix_cache else None
        self.max_pages = pages_for(max_len, page_size)  # the longest block table
        # Positions a request may reach: the context allowed, and what the whole pool holds.
        self.limit = min(max_len, num_pages * page_size)
        self._widths = self._table_widths()

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def available(self) -> int:
        """Pages a request may take: free ones and cached ones no request holds."""
        return self.allocator.num_free + (self.prefix.evictable if self.prefix is not None else 0)

    @property
    def usage(self) -> float:
        """The fraction of the pool's pages that requests hold."""
        return 1 - self.available / self.num_pages

    def check(self, prompt_len: int) -> None:
        if prompt_len >= self.limit:
            raise UsageError(f"prompt of {prompt_len} tokens and its first new token need "
                             f"{pages_for(prompt_len + 1, self.page_size)} pages of {self.page_size} positions; "
                             f"the KV cache holds {self.num_pages} (--kv-cache-tokens)")

    def take(self, n: int) -> list[int] | None:
        """n pages (free ones first, then the least recently used cached ones), or None when fewer
        are available (nothing taken)."""
        if n > self.available:
            return None
        out = self.allocator.allocate(min(n, self.allocator.num_free))
        out += [self.prefix.evict() for _ in range(n - len(out))]
        self.refs[out] = 1
        return out

    def hold(self, pages: list[int]) -> None:
        """Another request holds these pages too."""
        for page in pages:
            self.refs[page] += 1
            if self.prefix is not None:
                self.prefix.held(page)

    def release(self, pages: list[int]) -> None:
        """A request lets go of its pages: keyed ones no request holds stay cached, the rest are free."""
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0 and not (self.prefix is not None and self.prefix.keeps(page)):
                self.allocator.release([page])

    def admit(self, seq: list[int], forks: int = 0, cached: bool = True):
        """Pages for a request that prefills `seq` and then writes one position more, and one page
        for each of `forks` samples forked from it -> (its pages, its full pages' keys, positions
        found in the prefix cache, the forks' pages), or None when the pool lacks them.
        `cached` False: no lookup (the request needs every position computed)."""
        found, keys = [], []
        if self.prefix is not None and cached:
            # The last position is always computed: its logits give the next token.
            found, keys = self.prefix.match(seq[:-1])
            self.hold(found)
        fresh = self.take(pages_for(len(seq) + 1, self.page_size) - len(found) + forks)
        if fresh is None:
            self.release(found)
            return None
        own = len(fresh) - forks
        if self.prefix is not None and cached:
            self.prefix.count(len(seq) - 1, len(found) * self.page_size)
        return found + fresh[:own], keys, len(found) * self.page_size, fresh[own:]

    def needed(self, end: int) -> int:
        """Pages that hold positions 0 .. end - 1 (past the limit: none more)."""
        return pages_for(min(end, self.limit), self.page_size)

    def written(self, pages: list[int], keys: list[bytes], done: int) -> None:
        """A request's first `done` positions are written: its full pages join the prefix cache."""
        if self.prefix is not None:
            for page, key in zip(pages[: done // self.page_size], keys):
                self.prefix.register(page, key)

    def widths(self) -> list[int]:
        return self._widths

    def _table_widths(self) -> list[int]:
        """Block-table widths the programs compile for: MIN_TABLE_POSITIONS' pages times 1,
        TABLE_STEP, TABLE_STEP^2, ... and the longest request's pages (a power of two): a step
        reads about the pages its longest request holds, not every request's whole context."""
        top, width, out = bucket(self.max_pages), max(1, MIN_TABLE_POSITIONS // self.page_size), []
        while width < top:
            out.append(width)
            width *= TABLE_STEP
        return out + [top]

    def table(self, rows: list[list[int]], batch: int, positions: int) -> np.ndarray:
        """Block tables [batch, W] of `rows`' pages, W the narrowest width holding `positions`."""
        need = pages_for(max(positions, 1), self.page_size)
        width = next((w for w in self._widths if w >= need), self._widths[-1])  # widths ascend
        return self.allocator.table([r[:width] for r in rows], batch, width)

    def chunk_pages(self, pages: np.ndarray, start: np.ndarray, chunk: int) -> np.ndarray:
        """The ids [P * K] of the pages that hold `chunk` positions from `start` [P] in block tables
        `pages` [P, W] (no page past a table), K fixed: chunks start at multiples of the chunk
        after a whole number of cached pages, and K pages hold one from any such start."""
        k = pages_for(self.page_size - math.gcd(chunk, self.page_size) + chunk, self.page_size)
        cols = start[:, None] // self.page_size + np.arange(k)
        ids = np.take_along_axis(pages, np.minimum(cols, pages.shape[1] - 1), axis=1)
        return np.where(cols < pages.shape[1], ids, self.num_pages).reshape(-1)
