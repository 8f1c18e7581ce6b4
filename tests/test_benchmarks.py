"""The benchmark scripts stay runnable: the package imports none of them, and the GPU one is run
blind on borrowed device time, so a break must show here first. Each runs in its smallest
setting, imported into this process; the GPU ones interpreted, in processes of their own (the
grouped GEMMs' smoke run; the lent-GPU script's dry run, which runs the decode benchmark, the
grouped GEMMs, the tile tuner and `pytest -m gpu`)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sharding import registry

pytestmark = pytest.mark.slow  # each runs a benchmark end to end

DIR = Path(__file__).parent.parent / "benchmarks"
BENCHMARKS = sorted(p.name for p in DIR.glob("*.py"))
# Each script's smallest setting; {tmp} is the test's own directory.
SMALLEST = {
    "ab_settings.py": ["--smoke", "--rounds", "1", "--decode-steps", "2", "--prompt-len", "16", "plain="],
    "cli_vs_transformers.py": ["--smoke", "--rounds", "1"],
    "compile_depth.py": ["--layers", "1", "--placements", "tensor_sliced", "--devices", "1"],
    "gpu_decode.py": [
        "--smoke",
        "--batches",
        "1",
        "--new-tokens",
        "3",
        "--prompt-len",
        "8",
        "--formats",
        "bf16",
        "nvfp4",
        "--profile",
    ],
    "grouped_gemm_cpu.py": [
        "--experts",
        "8",
        "--hidden",
        "64",
        "--inter",
        "32",
        "--topk",
        "2",
        "--formats",
        "bf16",
        "nvfp4",
        "--batches",
        "1",
        "8",
        "--steps",
        "2",
        "--decode-tokens",
        "4",
        "--devices",
        "2",
        "--read-mb",
        "8",
    ],
    "load_memory.py": ["--layers", "1", "--dir", "{tmp}/load", "--smoke"],
    "model_vs_transformers.py": ["--smoke", "--decode-steps", "2", "--prompt-len", "16", "--rounds", "1"],
    "paged_decode.py": ["--smoke", "--rounds", "1"],
    "mtp.py": ["--smoke", "--batch", "1", "--new-tokens", "3"],
    "placement_pricing.py": ["--preset", "tiny-glm-5.3", "--batches", "8", "--placements", "expert_sharded"],
    "row_meets_experts.py": ["--steps", "5"],
    "simulator_validation.py": [
        "--devices",
        "2",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--costs",
        "{tmp}/costs.json",
        "--out",
        "{tmp}/traces",
    ],
    "soak.py": ["--steps", "2", "--placements", "expert_sharded"],
    "step_parts.py": ["--smoke", "--steps", "2", "--rounds", "1"],
}
IN_A_PROCESS = {"gpu_grouped_gemm.py", "lent_gpu.py", "tune_tiles.py"}  # tune_tiles: a part of lent_gpu's dry run
PARTS = ["decode", "grouped_gemm", "tune_tiles", "pytest"]  # lent_gpu's, in its order
# Scripts that run every registered placement, run here with the default one only.
ONE_PLACEMENT = {"simulator_validation.py"}


def test_every_benchmark_has_a_smallest_setting():
    assert sorted([*SMALLEST, *IN_A_PROCESS]) == BENCHMARKS


@pytest.mark.parametrize("name", sorted(SMALLEST))
def test_benchmark_runs_in_its_smallest_setting(name, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(DIR))  # the scripts import each other, as from their own folder
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored after a script sets it
    if name in ONE_PLACEMENT:
        monkeypatch.setattr(registry, "REGISTRY", {registry.DEFAULT: registry.REGISTRY[registry.DEFAULT]})
    spec = importlib.util.spec_from_file_location(f"benchmark_{name[:-3]}", DIR / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([a.format(tmp=tmp_path) for a in SMALLEST[name]])
    out = capsys.readouterr().out
    assert len(out.splitlines()) >= 2 and not re.search(r"\bnan\b", out, re.I), out


def test_gpu_benchmark_smoke_run_prints_every_kernel_row():
    script = DIR / "gpu_grouped_gemm.py"
    run = subprocess.run([sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "FAILED" not in run.stdout, run.stdout
    rows = [f for f in map(str.split, run.stdout.splitlines()) if f[:1] in (["ragged_dot"], ["interpret_triton"])]
    # ragged_dot plus bf16 / nvfp4 / mxfp4 kernels at each of the smoke's two batch sizes
    assert [r[1] for r in rows] == ["bf16", "bf16", "nvfp4", "mxfp4"] * 2
    errors = {r[1]: float(r[-1]) for r in rows}
    assert errors["bf16"] < 1e-2  # the bf16 kernel against ragged_dot: same products


def test_lent_gpu_dry_run_writes_every_part(tmp_path):
    """The lent-GPU script's dry run: every part ran, its rows in results.json and a table each in
    results.md; the tuner's entries say they are a dry run's; pytest -m gpu ran and skipped all."""
    script = DIR / "lent_gpu.py"
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "--dry-run"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    parts = results["parts"]
    assert {name: part["status"] for name, part in parts.items()} == dict.fromkeys(PARTS, "ok"), parts
    assert [(r["experts"], r["batch"]) for r in parts["decode"]["rows"]] == [("bf16", 1), ("nvfp4", 1)]
    assert all("error" not in r for part in ("decode", "grouped_gemm") for r in parts[part]["rows"])
    assert {r["kernel"].split()[0] for r in parts["grouped_gemm"]["rows"]} == {"ragged_dot", "interpret_triton"}
    assert {(r["kernel"], r["product"]) for r in parts["tune_tiles"]["rows"] if r["best_us"]} == {
        ("pick_gemm", "gate_up"),
        ("pick_gemm", "down"),
        ("fused_linear", "qkv"),
        ("fused_linear", "out"),
        ("fused_linear", "router"),
    }
    tuned = json.loads((tmp_path / "tiles_tuned.json").read_text())["entries"]
    assert all(e["from"].startswith("dry-run") for devices in tuned.values() for es in devices.values() for e in es)
    assert parts["pytest"]["about"]["skipped"] > 0 and set(parts["pytest"]["about"]) == {"skipped", "summary"}
    markdown = (tmp_path / "results.md").read_text()
    headings = [line.split(",")[0] for line in markdown.splitlines() if line.startswith("## ")]
    assert headings == [f"## {p}: ok" for p in PARTS], markdown


@pytest.fixture
def tune_tiles(monkeypatch):
    monkeypatch.syspath_prepend(str(DIR))  # it imports the GPU benchmarks' pieces, as from its own folder
    spec = importlib.util.spec_from_file_location("benchmark_tune_tiles", DIR / "tune_tiles.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_tune_tiles_refuses_to_write_a_dry_run(tune_tiles, capsys):
    """A dry run's entries are interpreted timings at tiny shapes: never merged into the table."""
    with pytest.raises(SystemExit) as refused:
        tune_tiles.main(["out.json", "--dry-run", "--write"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "tune_tiles: a dry run's entries are not timings; --write and --merge take a GPU run's"
    ]


def test_tune_tiles_merge_replaces_the_devices_entry_of_the_shape(tune_tiles, tmp_path, monkeypatch, capsys):
    """A GPU run's entry replaces the table's of the same device, rows, K, N and format, and leaves
    the others; a dry run's file is refused."""
    table = tmp_path / "tiles.json"
    table.write_text(tune_tiles.tiles.TABLE.read_text())
    monkeypatch.setattr(tune_tiles.tiles, "TABLE", table)
    before = json.loads(table.read_text())["pick_gemm"]["NVIDIA H200"]
    timed = {
        "rows": 1,
        "k": 2048,
        "n": 1536,
        "fmt": "bf16",
        "tiles": {"tm": 16, "tn": 32, "tk": 128, "num_warps": 4, "num_stages": 3},
        "from": "timed on NVIDIA H200 (gate_up: 9.0 us a call, the fastest of 9 candidates), 2026-12-07",
    }
    run = tmp_path / "tuned.json"
    run.write_text(json.dumps({"dry_run": False, "entries": {"pick_gemm": {"NVIDIA H200": [timed]}}}))
    tune_tiles.main(["--merge", str(run)])
    after = json.loads(table.read_text())["pick_gemm"]["NVIDIA H200"]
    assert after == [e for e in before if (e["rows"], e["k"], e["n"]) != (1, 2048, 1536)] + [timed]
    run.write_text(json.dumps({"dry_run": True, "entries": {}}))
    with pytest.raises(SystemExit) as refused:
        tune_tiles.main(["--merge", str(run)])
    assert refused.value.code == 2 and "dry run" in capsys.readouterr().err
