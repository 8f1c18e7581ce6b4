"""Prefix caching: full KV pages keyed by the hash chain of their tokens (vLLM's automatic prefix
caching). A request whose prompt starts with the tokens of cached pages holds those pages and
prefills only the rest; a keyed page no request holds stays cached until the pool needs it,
least recently used first. Host-side only: it hands out page ids (`kv_pages.py`)."""

from __future__ import annotations

import collections
import hashlib

import numpy as np


def block_hashes(tokens: list[int], page_size: int) -> list[bytes]:
    """One key per full page of `tokens`: page i's tokens chained to page i - 1's key, so equal
    keys mean equal tokens from position 0 (a page's entries depend on everything before it)."""
    keys, prev = [], b""
    for i in range(len(tokens) // page_size):
        page = np.asarray(tokens[i * page_size : (i + 1) * page_size], np.int64).tobytes()
        prev = hashlib.blake2b(prev + page, digest_size=16).digest()
        keys.append(prev)
    return keys


class PrefixCache:
    """Which page holds which key; the keyed pages no request holds, oldest use first."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.unheld: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.queries = self.hits = 0  # admitted prompts' positions looked up, and found cached

    @property
    def evictable(self) -> int:
        """Pages the pool may take back."""
        return len(self.unheld)

    def match(self, tokens: list[int]) -> tuple[list[int], list[bytes]]:
        """(the pages of the longest cached prefix of `tokens`, the keys of all its full pages)."""
        keys, pages = block_hashes(tokens, self.page_size), []
        for key in keys:
            if key not in self.page_of:
                break
            pages.append(self.page_of[key])
        return pages, keys

    def count(self, looked_up: int, found: int) -> None:
        """An admitted request's lookup (one retried while the pool was short counts once)."""
        self.queries += looked_up
        self.hits += found

    def register(self, page: int, key: bytes) -> None:
        """A held page now holds the full page of tokens `key` names (the first such page keeps the key)."""
        if key not in self.page_of and page not in self.key_of:
            self.page_of[key], self.key_of[page] = page, key

    def held(self, page: int) -> None:
        self.unheld.pop(page, None)

    def keeps(self, page: int) -> bool:
        """A page no request holds any more: cached (True) when keyed, else free for the pool."""
        if page in self.key_of:
            self.unheld[page] = None
            return True
        return False

    def evict(self) -> int:
        """The least recently used unheld page, its key forgotten."""
        page, _ = self.unheld.popitem(last=False)
        del self.page_of[self.key_of.pop(page)]
        return page
