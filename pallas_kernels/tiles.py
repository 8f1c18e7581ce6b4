"""Every kernel's tiles, as data: `tiles.json`, by kernel, device and shape; `lookup` is the one way in.

A kernel takes its tiles as an argument (its module's `Tiles`, or a dict of them); the registry and
the attention entry look them up here and hand them on. The table's entries say where they come
from: a device's own timing, a published tuned table, or a rule of the call's shape (the sizes
kernels once fixed in code, with the reason for them). A rule's fields are resolved against the
call's shape by `_resolve`.

A decode step's products are a few rows against a whole weight, so a decode kernel's speed is how
many of the device's SMs its programs keep streaming: given `programs`, `lookup` narrows the entry's
N tile while the call's active programs would fill the SMs less than FILL times over (a program
streams one tile of weight columns; fewer, wider programs leave SMs idle), down to a floor (a
narrower tile reads each weight row in slivers shorter than a memory transaction); where the entry
splits K (a field "splits"), the splits then double while the programs still fall short, up to the
caller's bound (what the slices' partials cost it), each split whole K tiles (the K tile halving,
down to its floor, when they run out). An entry timed on its device (`benchmarks/tune_tiles.py`)
stands as it is: the timing weighed the narrower tiles and the splits too.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

TABLE = Path(__file__).with_name("tiles.json")
FILL = 2  # programs per SM a decode call aims for
ANY = "any device"  # a kernel's list of entries for every device (rules)
TIMED = "timed on"  # how a timed entry's "from" begins: "timed on DEVICE ..., DATE"


@functools.cache
def _table() -> dict:
    return json.loads(TABLE.read_text())


def round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def pow2(n: int) -> int:
    """The power of two at least n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def pick_tile(dim: int, candidates: tuple[int, ...], multiple_of: int = 1, masked: bool = False) -> int:
    """The largest candidate dividing dim (and a multiple of `multiple_of`), else dim whole; or,
    `masked` (a kernel whose blocks must be candidates, e.g. Triton's powers of two, and that
    masks the tile past dim's end), the smallest candidate covering dim, else the largest."""
    fits = [c for c in candidates if c % multiple_of == 0]
    for c in fits:
        if dim % c == 0:
            return c
    if not masked:
        return dim
    return min((c for c in fits if c >= dim), default=max(fits))


def _matches(entry: dict, fmt: str, gated: bool) -> bool:
    fmts = entry.get("fmt", fmt)
    return fmt in (fmts if isinstance(fmts, list) else [fmts]) and entry.get("gated", gated) == gated


def _entry(kernel: str, device_kind: str, rows: int, k: int, n: int, fmt: str, gated: bool) -> dict:
    """The table's entry for the shape: among the device's entries, then every device's, those of the
    same K and N (and format and gating), else of the same format and gating; among those, the least
    row count at or above `rows` (an entry without rows: any), else the largest; else the default."""
    table = _table()[kernel]
    for entries in (table.get(device_kind, []), table.get(ANY, [])):
        for same in (lambda e: (e.get("k"), e.get("n")) == (k, n), lambda e: True):
            found = [e for e in entries if same(e) and _matches(e, fmt, gated)]
            if found:
                size = lambda e: e.get("rows", float("inf"))
                above = [e for e in found if size(e) >= rows]
                return min(above, key=size) if above else max(found, key=size)
    return table["default"]


def _resolve(field, *, rows: int, k: int, n: int, block: int) -> int:
    """A field's size for the call: a size as it stands, or a rule of the call's shape:
    {"rows": [lo, hi]}: the rows' power of two, lo to hi; {"rows_by": [step, hi]}: the rows in whole
    steps, at most hi; {"of": "k" or "n", "tiles": [..]}: `pick_tile` of that width ("masked": the
    kernel masks an edge tile; a K tile of 4-bit weights of scale block B is a multiple of 2B, two
    K-halves of whole blocks), and with "scale_sublanes": s, K whole where a tile's tk/2/B scale rows
    are no whole multiple of s (a Mosaic TPU tile of 8-bit data)."""
    if isinstance(field, int):
        return field
    if "rows" in field:
        lo, hi = field["rows"]
        return min(hi, max(lo, pow2(rows)))
    if "rows_by" in field:
        step, hi = field["rows_by"]
        return min(hi, round_up(rows, step))
    dim = {"k": k, "n": n}[field["of"]]
    multiple = 2 * block if field["of"] == "k" else 1
    tile = pick_tile(dim, tuple(field["tiles"]), multiple, field.get("masked", False))
    if "scale_sublanes" in field and block > 1 and (tile // 2 // block) % field["scale_sublanes"]:
        return k
    return tile


def lookup(
    kernel: str,
    device: tuple[str, int] = ("", 0),
    *,
    rows: int = 0,
    k: int = 0,
    n: int = 0,
    fmt: str = "bf16",
    gated: bool = False,
    block: int = 1,
    programs: Callable[[int, int], int] | None = None,
    tn_floor: int = 16,
    n_field: str = "tn",
    tk_floor: int = 32,
    k_field: str = "tk",
    max_splits: int = 1,
) -> dict:
    """`kernel`'s tiles (a dict of its Tiles' fields) for `rows` rows of a [K, N] product with weights
    in `fmt` ("bf16", "f32", "nvfp4", "mxfp4"; 4-bit of scale block `block`), `gated`: a gate|up
    product whose epilogue halves it, on `device`: (device kind, SMs; ("", 0): the rules, unnarrowed).
    `programs(tn, splits)`: a decode kernel's programs at N tile tn and K in `splits` slices; the N
    tile (the field `n_field`) halves, down to `tn_floor`, until they fill every SM FILL times over;
    then an entry's "splits" double, up to `max_splits`, each slice whole K tiles (the field
    `k_field`, halving down to `tk_floor` where they run out). Not an entry timed on its device."""
    kind, cores = device
    entry = _entry(kernel, kind, rows, k, n, fmt, gated)
    out = {name: _resolve(v, rows=rows, k=k, n=n, block=block) for name, v in entry["tiles"].items()}
    timed = entry["from"].startswith(TIMED)
    short = lambda: (  # noqa: E731
        programs and cores and not timed and programs(out[n_field], out.get("splits", 1)) < FILL * cores
    )
    while short() and out[n_field] > tn_floor:
        out[n_field] //= 2
    while short() and "splits" in out and 2 * out["splits"] <= max_splits:
        if k % (out[k_field] * 2 * out["splits"]) == 0:
            out["splits"] *= 2
        elif out[k_field] > tk_floor:
            out[k_field] //= 2
        else:
            break
    return out
