"""A scheduler's KV pages on the host: the pool's size, who holds each page (a count: n samples
of a prompt and prefix-cache hits share pages), each request's pages at admission (those of a
cached prefix, then fresh ones), the block tables its programs read, and the prefix cache; under
DP attention each rank's own. The pool's arrays live on the devices; the scheduler owns them
(`scheduler.py`)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import numpy as np

from moejax.base.errors import UsageError
from moejax.engine.buckets import bucket
from moejax.engine.kv_cache import page_bytes
from moejax.engine.pages import PageAllocator, pages_for
from moejax.serving.prefix_cache import PrefixCache

PAGE_SIZE = 16  # positions per page (--page-size)
# Block-table widths a program compiles for: this many positions, x4, x16, ... and the longest
# request's (a narrower read saves less than another set of programs costs to compile).
MIN_TABLE_POSITIONS = 128
TABLE_STEP = 4


def window_held(c, page_size: int, chunk: int, max_len: int) -> int:
    """The most sliding-window pages a request holds at once: a prefill chunk's positions and the
    window before its first (one page more where they straddle a page), or all it ever writes."""
    return min(pages_for(c.sliding_window - 1 + chunk, page_size) + 1, pages_for(max_len, page_size))


def window_pool_pages(c, page_size: int, chunk: int, max_len: int, slots: int) -> int:
    """The sliding-window layers' own pool (0: a model without them): every slot's `window_held`,
    so window pages never run short while the full group's pages last."""
    return slots * window_held(c, page_size, chunk, max_len) if c.sliding_layers else 0


def pool_pages(
    engine,
    page_size: int,
    kv_tokens: int = 0,
    kv_gb: float = 0.0,
    multiple: int = 1,
    mtp: bool = False,
    window_pages: int = 0,
) -> int:
    """Pages of the (full-attention layers') pool: `kv_tokens` positions, or `kv_gb` GB, or the
    platform's default (`Platform.kv_cache_tokens`, else `Platform.kv_cache_bytes`), rounded up to
    a multiple of `multiple` (with DP attention each rank holds an equal share). `mtp`: the MTP
    layer's pool of as many pages shares the bytes; `window_pages`: the sliding-window layers' pool
    takes its bytes first."""
    if page_size < 1 or kv_tokens < 0 or kv_gb < 0:
        raise UsageError(
            f"--page-size {page_size}, --kv-cache-tokens {kv_tokens} and --kv-cache-gb {kv_gb} must be positive"
        )
    if kv_tokens and kv_gb:
        raise UsageError("give --kv-cache-tokens or --kv-cache-gb, not both")
    # The pool's layout is the attention kernel's (the TPU kernel's pads head_dim to 128 lanes).
    kernel = engine.placement.attention_kernel
    per_page = page_bytes(engine.c, page_size, engine.dtype, kernel, mtp, window=False)
    platform = engine.placement.platform
    if kv_tokens or (not kv_gb and platform.kv_cache_tokens):
        pages = pages_for(kv_tokens or platform.kv_cache_tokens, page_size)
    else:
        size = kv_gb * 1e9 or platform.kv_cache_bytes(list(jax.tree.leaves(engine.params)[0].devices()))
        window_bytes = window_pages * page_bytes(engine.c, page_size, engine.dtype, kernel, window=True)
        pages = int(max(0.0, size - window_bytes) // per_page)
        if not kv_gb and jax.process_count() > 1:  # each read its own free memory: all take the least
            from jax.experimental import multihost_utils

            pages = int(multihost_utils.process_allgather(np.int64(pages)).min())
    return max(multiple, -(-pages // multiple) * multiple)


class PrefixCounts(NamedTuple):
    """Prompt positions of admitted requests looked up in the prefix caches, and found cached."""

    queries: int
    hits: int


class KVPages:
    """`ranks` DP ranks (DP attention: each device holds its share of the pool's pages) each hand
    out their own pages, ids rank * rank_pages .. (rank + 1) * rank_pages - 1, with their own
    allocator and prefix cache: a request's pages all lie on the rank that runs its rows."""

    def __init__(self, num_pages: int, page_size: int, max_len: int, prefix_cache: bool, ranks: int = 1):
        if num_pages % ranks:
            raise ValueError(f"a pool of {num_pages} pages does not split over {ranks} ranks")
        self.page_size, self.ranks, self.num_pages = page_size, ranks, num_pages
        self.rank_pages = num_pages // ranks
        self.allocators = [PageAllocator(self.rank_pages, page_size) for _ in range(ranks)]
        self.refs = np.zeros(num_pages, np.int32)  # requests holding each page
        self.prefixes = [PrefixCache(page_size) for _ in range(ranks)] if prefix_cache else None
        self.max_pages = pages_for(max_len, page_size)  # the longest block table
        # Positions a request may reach: the context allowed, and what its rank's pages hold.
        self.limit = min(max_len, self.rank_pages * page_size)
        self._widths = self._table_widths()

    def rank_of(self, page: int) -> int:
        return page // self.rank_pages

    def available(self, rank: int) -> int:
        """Pages a request on `rank` may take: free ones and cached ones no request holds."""
        cached = self.prefixes[rank].evictable if self.prefixes is not None else 0
        return self.allocators[rank].num_free + cached

    @property
    def usage(self) -> float:
        """The fraction of the pool's pages (every rank's) that requests hold."""
        return 1 - sum(map(self.available, range(self.ranks))) / self.num_pages

    @property
    def prefix(self) -> PrefixCounts | None:
        """The prefix caches' counts over every rank (None: no prefix cache)."""
        if self.prefixes is None:
            return None
        return PrefixCounts(sum(p.queries for p in self.prefixes), sum(p.hits for p in self.prefixes))

    def check(self, prompt_len: int) -> None:
        if prompt_len >= self.limit:
            held = (
                f"a rank's share of the KV cache holds {self.rank_pages}"
                if self.ranks > 1
                else f"the KV cache holds {self.num_pages}"
            )
            raise UsageError(
                f"prompt of {prompt_len} tokens and its first new token need "
                f"{pages_for(prompt_len + 1, self.page_size)} pages of {self.page_size} positions; "
                f"{held} (--kv-cache-tokens)"
            )

    def take(self, n: int, rank: int = 0) -> list[int] | None:
        """n pages of `rank` (free ones first, then the least recently used cached ones), or None
        when fewer are available (nothing taken)."""
        if n > self.available(rank):
            return None
        allocator, first = self.allocators[rank], rank * self.rank_pages
        out = [first + page for page in allocator.allocate(min(n, allocator.num_free))]
        out += [self.prefixes[rank].evict() for _ in range(n - len(out))]
        self.refs[out] = 1
        return out

    def hold(self, pages: list[int]) -> None:
        """Another request holds these pages too."""
        for page in pages:
            self.refs[page] += 1
            if self.prefixes is not None:
                self.prefixes[self.rank_of(page)].held(page)

    def release(self, pages: list[int]) -> None:
        """A request lets go of its pages: keyed ones no request holds stay cached, the rest are free."""
        for page in pages:
            self.refs[page] -= 1
            rank = self.rank_of(page)
            if self.refs[page] == 0 and not (self.prefixes is not None and self.prefixes[rank].keeps(page)):
                self.allocators[rank].release([page - rank * self.rank_pages])

    def admit(self, seq: list[int], forks: int = 0, cached: bool = True, ranks: list[int] = (0,)):
        """Pages for a request that prefills `seq` and then writes one position more, and one page
        for each of `forks` samples forked from it, on one of `ranks` (that whose prefix cache
        holds the longest prefix, then that with the most pages available) -> (its rank, its
        pages, its full pages' keys, positions found in the prefix cache, the forks' pages), or
        None when no such rank has them. `cached` False: no lookup (every position computed)."""
        best = None
        for rank in ranks:
            found, keys = [], []
            if self.prefixes is not None and cached:
                # The last position is always computed: its logits give the next token.
                found, keys = self.prefixes[rank].match(seq[:-1])
            need = pages_for(len(seq) + 1, self.page_size) - len(found) + forks
            # A found page no request holds counts as available: held now, it is no longer.
            spare = self.available(rank) - sum(self.refs[page] == 0 for page in found)
            if need <= spare and (best is None or (len(found), spare) > (len(best[1]), best[3])):
                best = (rank, found, keys, spare, need)
        if best is None:
            return None
        rank, found, keys, _, need = best
        self.hold(found)
        fresh = self.take(need, rank)
        own = len(fresh) - forks
        if self.prefixes is not None and cached:
            self.prefixes[rank].count(len(seq) - 1, len(found) * self.page_size)
        return rank, found + fresh[:own], keys, len(found) * self.page_size, fresh[own:]

    def needed(self, end: int) -> int:
        """Pages that hold positions 0 .. end - 1 (past the limit: none more)."""
        return pages_for(min(end, self.limit), self.page_size)

    def written(self, pages: list[int], keys: list[bytes], done: int) -> None:
        """A request's first `done` positions are written: its full pages join its rank's prefix cache."""
        if self.prefixes is not None:
            for page, key in zip(pages[: done // self.page_size], keys):
                self.prefixes[self.rank_of(page)].register(page, key)

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
        out = np.full((batch, width), self.num_pages, np.int32)  # no page
        for i, ids in enumerate(rows):
            out[i, : len(ids)] = ids[:width]
        return out

    def chunk_pages(self, pages: np.ndarray, start: np.ndarray, chunk: int) -> np.ndarray:
        """The ids [P * K] of the pages that hold `chunk` positions from `start` [P] in block tables
        `pages` [P, W] (no page past a table), K fixed: chunks start at multiples of the chunk
        after a whole number of cached pages, and K pages hold one from any such start."""
        k = pages_for(self.page_size - math.gcd(chunk, self.page_size) + chunk, self.page_size)
        cols = start[:, None] // self.page_size + np.arange(k)
        ids = np.take_along_axis(pages, np.minimum(cols, pages.shape[1] - 1), axis=1)
        return np.where(cols < pages.shape[1], ids, self.num_pages).reshape(-1)
