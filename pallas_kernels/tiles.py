"""The decode kernels' tiles, as data: `decode_tiles.json`, by kernel, device and shape.

A decode step's products are a few rows against a whole weight, so a kernel's speed is how many of
the device's SMs its programs keep streaming. The table holds published tuned configurations of the
same shapes (until a device's own sweep replaces them); `tiles` takes the entry nearest a call's
shape and then narrows its N tile while the call's active programs would fill the SMs less than
twice over (a program streams one tile of weight columns; fewer, wider programs leave SMs idle).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

TABLE = Path(__file__).with_name("decode_tiles.json")
FILL = 2  # programs per SM a call aims for


@functools.cache
def _table() -> dict:
    return json.loads(TABLE.read_text())


def _entry(kernel: str, device_kind: str, rows: int, k: int, n: int, fmt: str) -> dict:
    """The table's tiles for the shape: same K, N and format, else same format, else the default;
    among those, the least row count at or above `rows`, else the largest."""
    table = _table()[kernel]
    entries = table.get(device_kind, [])
    for same in (lambda e: (e["k"], e["n"], e["fmt"]) == (k, n, fmt), lambda e: e["fmt"] == fmt):
        found = [e for e in entries if same(e)]
        if found:
            above = [e for e in found if e["rows"] >= rows]
            return min(above, key=lambda e: e["rows"]) if above else max(found, key=lambda e: e["rows"])
    return table["default"]


def tiles(
    kernel: str,
    device: tuple[str, int],
    *,
    rows: int,
    k: int,
    n: int,
    fmt: str,
    programs: Callable[[int], int],
    tn_floor: int = 16,
    n_field: str = "tn",
) -> dict:
    """`kernel`'s tiles (a dict of its Tiles' fields) for `rows` rows of a [K, N] product with weights
    in `fmt` ("bf16", "f32", "nvfp4", "mxfp4") on `device`: (device kind, SMs; ("", 0): the
    defaults, unnarrowed). `programs(tn)`: the programs a call with N tile tn keeps busy; the N
    tile (the field `n_field`) halves, down to `tn_floor`, until they fill every SM FILL times over."""
    kind, cores = device
    entry = _entry(kernel, kind, rows, k, n, fmt)
    out = dict(entry.get("tiles", entry))
    while cores and out[n_field] > tn_floor and programs(out[n_field]) < FILL * cores:
        out[n_field] //= 2
    return out
