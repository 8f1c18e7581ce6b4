"""Tiles are data: every kernel takes its tiles as an argument and the one table (`pallas_kernels/tiles.json`,
read by `tiles.lookup`) holds them, each entry saying where it came from; no kernel fixes them in code."""

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from pallas_kernels import tiles

KERNELS = Path(tiles.__file__).parent
# A warps or stages launch setting given as a number, and module-level tile sizes, warps, stages,
# splits or SM counts (`TM = 128`, `GPU_SMS = 132`): the table's to say.
FIXED_LAUNCH = re.compile(r"\b(num_warps|num_stages)\s*=\s*\d")
FIXED_TILE = re.compile(
    r"^(T[MNK]B?|EPILOGUE_ROWS|\w*(WARPS|STAGES|SPLITS|_SMS|WAVES|PER_BLOCK)\w*)(\s*,\s*\w+)*\s*=\s*\d", re.M
)
ORIGINS = re.compile(r"^(timed on .+, \d{4}-\d{2}-\d{2}|published table of .+|rule: .+)$")
# The kernels' modules with their tiles' dataclass, by the table's key.
TILED = {
    "triton": "gmm_pallas_gpu",
    "pallas_tpu": "gmm_pallas_tpu",
    "mosaic_gpu": "gmm_mosaic_gpu",
    "blackwell": "gmm_blackwell",
    "blackwell_bf16": "gmm_blackwell_bf16",
    "pick_gemm": "gmm_picks",
    "pick_gemm_mgpu": "gmm_picks_mgpu",
    "fused_linear": "linear",
    "linear_mgpu": "linear_mgpu",
    "topk_route": "routing",
}


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_no_kernel_fixes_its_tiles_in_code(path):
    text = path.read_text()
    assert not FIXED_LAUNCH.findall(text), f"{path.name} fixes num_warps / num_stages; take them from the tiles"
    assert not FIXED_TILE.findall(text), f"{path.name} has module-level tile constants; put them in tiles.json"


def test_every_entry_says_where_it_came_from():
    table = tiles._table()
    for kernel, entries in table.items():
        if kernel.startswith("_"):
            continue
        listed = [entries["default"]] + [e for key, group in entries.items() if key != "default" for e in group]
        for entry in listed:
            assert ORIGINS.match(entry.get("from", "")), (kernel, entry)


@pytest.mark.parametrize("key", list(TILED))
def test_the_table_gives_every_field_of_a_kernels_tiles(key):
    """Each entry of a kernel has exactly its Tiles' fields, so the registry builds them from any."""
    fields = {f.name for f in dataclasses.fields(importlib.import_module(f"pallas_kernels.{TILED[key]}").Tiles)}
    entries = tiles._table()[key]
    listed = [entries["default"]] + [e for name, group in entries.items() if name != "default" for e in group]
    assert all(set(e["tiles"]) == fields for e in listed)


def test_rules_resolve_against_the_shape():
    """A rule's fields follow the call: the Triton GEMM's rows and masked K and N tiles, the TPU's
    4-bit K whole where a tile's scale rows do not fill a Mosaic tile, a gated product's own entry."""
    assert tiles.lookup("triton", rows=12, k=40, n=24) == dict(tm=16, tk=64, tn=32, num_warps=4, num_stages=2)
    assert tiles.lookup("triton", rows=300, k=256, n=48, gated=True)["tn"] == 64
    assert tiles.lookup("pallas_tpu", rows=70, k=256, n=256, fmt="nvfp4", block=16) == dict(tm=80, tk=256, tn=256)
    assert tiles.lookup("pallas_tpu", rows=70, k=8192, n=512, fmt="mxfp4", block=32)["tk"] == 2048
    assert tiles.lookup("mosaic_gpu", rows=70, k=256, n=256, fmt="nvfp4", gated=True)["tn"] == 128


def test_attention_splits_follow_the_devices_sms():
    """The GPU attention's splits cover the device's SMs (not a constant's): more SMs, more splits,
    up to the table's most; a device of unknown SMs takes the most the table's blocks allow."""
    from pallas_kernels.paged_attention import gpu_blocks

    shape = (4, 8, 8, 64, 16, 512, "bfloat16")  # 32 (request, kv head) CTAs a split
    splits = {sms: gpu_blocks(*shape, ("a GPU", sms))[1] for sms in (16, 64, 132)}
    assert splits == {16: 1, 64: 2, 132: 5}
    assert gpu_blocks(*shape, ("", 0))[1] == tiles.lookup("paged_attention_mgpu")["max_splits"]


def test_a_timed_entry_is_not_narrowed(monkeypatch):
    """The fill rule narrows a rule's or a published table's N tile for a call of too few programs;
    an entry timed on the device stands: its timing weighed the narrower tiles."""
    published = {"tiles": {"tn": 128}, "from": "published table of a test"}
    timed = {"rows": 1, "tiles": {"tn": 128}, "from": "timed on a GPU, 2026-12-07"}
    monkeypatch.setattr(tiles, "_table", lambda: {"k": {"default": published, "a GPU": [timed]}})
    two_programs = lambda tn, splits: 256 // tn * splits
    assert tiles.lookup("k", ("another GPU", 8), rows=1, programs=two_programs)["tn"] == 16
    assert tiles.lookup("k", ("a GPU", 8), rows=1, programs=two_programs)["tn"] == 128


def test_a_decode_kernels_tiles_fill_the_sms_narrowing_then_splitting_k():
    """A decode call of too few column tiles: its N tile halves down to its floor, then its K splits
    double (whole K tiles each, the K tile halving where they run out) until its programs cover
    the device's SMs FILL times over, up to the caller's most splits; a device of unknown SMs, none."""
    cols = lambda n: lambda tn, splits: -(-n // tn) * splits  # noqa: E731
    lookup = lambda sms, **kw: tiles.lookup(  # noqa: E731
        "fused_linear", ("a GPU", sms), rows=1, k=4096, n_field="n", k_field="k", tn_floor=64, **kw
    )
    # N 2048: 32 tiles of 64 over 132 SMs, so 16 slices of 256 K rows (4 tiles of 64): 512 programs.
    out = lookup(132, n=2048, programs=cols(2048), max_splits=64)
    assert (out["n"], out["k"], out["splits"]) == (64, 64, 16)
    assert lookup(132, n=2048, programs=cols(2048), max_splits=4)["splits"] == 4
    # N 128: 2 tiles; 64 slices of K tiles of 64 (128 programs), then 128 of 32 (256), the K tile's
    # floor: short of 264, but all it can.
    out = lookup(132, n=128, programs=cols(128), max_splits=1024)
    assert (out["k"], out["splits"]) == (32, 128)
    assert lookup(0, n=2048, programs=cols(2048), max_splits=64)["splits"] == 1
