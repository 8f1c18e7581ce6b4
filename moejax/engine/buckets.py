"""Shape buckets: batch and cache lengths round up to powers of two, prompts to whole prefill
chunks, a decode block's visible cache to steps of an eighth, so that a new request mix
recompiles only when a bucket changes."""

from __future__ import annotations

# Position counts (prompt widths, cache lengths) round up to powers of two of at least this, so
# that short prompts and caches share their compiled programs.
MIN_POSITIONS = 16


def bucket(n: int, minimum: int = 1) -> int:
    """n rounded up to a power of two, at least `minimum`."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


# A decode block attends to its cache's first positions rounded up to a multiple of an eighth of
# the next power of two, and of at least this: few programs, and at most 1/8 read past the rows.
DECODE_VISIBLE_STEP = 128


def decode_visible(n: int) -> int:
    """The cache positions a decode block reaching position n - 1 reads (545 -> 640, 1000 -> 1024)."""
    step = max(DECODE_VISIBLE_STEP, bucket(n) // 8)
    return -(-n // step) * step
