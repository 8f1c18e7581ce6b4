"""The host side of a paged KV cache: which pages of the pool are free. The pool's arrays live on
the devices (`kv_cache.init_pool`); this only hands out page ids (block tables: `serving/kv_pages.py`)."""

from __future__ import annotations

import collections


def pages_for(positions: int, page_size: int) -> int:
    return -(-positions // page_size)


class PageAllocator:
    """Free pages of a pool of `num_pages`; page id `num_pages` names no page (see `model/paged.py`)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"a page pool needs pages and positions per page, got {num_pages} x {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.free: collections.deque[int] = collections.deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int] | None:
        """n free pages (lowest first), or None when fewer are free (nothing taken)."""
        if n > len(self.free):
            return None
        return [self.free.popleft() for _ in range(n)]

    def release(self, ids: list[int]) -> None:
        self.free.extend(ids)
