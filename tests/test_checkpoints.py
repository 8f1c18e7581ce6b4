"""Checkpoints: convert from transformers, restore into every placement, survive damage."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from layouts import placement_layouts

from checkpoints import legacy, orbax_io
from checkpoints.manifest import FORMAT_VERSION, MANIFEST, Manifest, read_manifest
from checkpoints.orbax_io import restore_params, save_params
from moejax.base import platform
from moejax.cli import main
from moejax.config import PRESETS, Config, WeightsConfig
from moejax.launch.loading import load_params, with_hf_model
from pallas_kernels import QuantizedArray
from sharding import make_placement

GOLDEN = Path(__file__).parent / "golden" / "deepseek_v3"
ROOT = Path(__file__).parent.parent
LAYOUTS = placement_layouts()
# 12 experts do not divide ep=8: expert_sharded, ragged_a2a and weight_prefetch pad to 16,
# hybrid (ep=4) and tensor_sliced (ep=1) do not pad. 4-bit runs use the preset's 16.
MODELS = {"unquantized": dataclasses.replace(PRESETS["tiny"], num_experts=12), "nvfp4": PRESETS["tiny"]}


def cli(argv: list, capsys) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@functools.cache
def placed(layout: str, fmt: str):
    config = Config(model=MODELS[fmt], layout=LAYOUTS[layout], weights=WeightsConfig(fmt)).validate()
    placement = make_placement(config)
    return config, placement, load_params(config, placement, seed=0)


def assert_identical(restored, expected):
    is_leaf = lambda x: x is None
    assert jax.tree.structure(restored, is_leaf=is_leaf) == jax.tree.structure(expected, is_leaf=is_leaf)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The golden model converted in groups of one tensor's size, so that it has many."""
    ckpt = tmp_path_factory.mktemp("converted") / "ckpt"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(orbax_io, "GROUP_BYTES", 0)
        assert main(["convert", "--hf", str(GOLDEN), "--out", str(ckpt), "--json"]) == 0
    return ckpt


# ----------------------------------------------------------------------------- convert


@pytest.mark.slow
def test_converted_checkpoint_generates_the_tokens_of_the_transformers_directory(converted, capsys):
    """expected.npz holds transformers' greedy tokens, which generating from the directory
    reproduces (test_model.py); one engine here instead of two keeps the test short."""
    expected = np.load(GOLDEN / "expected.npz")
    prompt = ",".join(map(str, expected["prompt"].tolist()))
    rc, out, _ = cli(
        ["generate", "--checkpoint", converted, "--prompt-ids", prompt, "--max-new-tokens", "16", "--json"], capsys
    )
    assert rc == 0 and json.loads(out)["tokens"] == [expected["greedy"].tolist()]


@pytest.mark.slow
def test_convert_with_json_prints_one_document_and_no_progress(tmp_path, capsys):
    rc, out, err = cli(["convert", "--hf", GOLDEN, "--out", tmp_path / "ckpt", "--json"], capsys)
    assert rc == 0 and err == ""
    assert (
        json.loads(out)["tensors"] == 31
    )  # 4 layers as 2 runs (dense, MoE): each run's parameters stacked, gate_up one


def test_groups_hold_at_most_the_largest_tensor(converted):
    """The writer's memory bound: a group never outgrows the model's largest parameter."""
    manifest = read_manifest(converted)
    sizes = {
        k: orbax_io._nbytes(orbax_io.stored_leaves(spec, manifest)) for k, spec in orbax_io.named_specs(manifest)[0]
    }
    assert len(manifest.groups) > 1
    assert all(sum(sizes[k] for k in group) <= max(sizes.values()) for group in manifest.groups)


# ----------------------------------------------------------------------------- placements


@pytest.mark.parametrize("fmt", MODELS)
@pytest.mark.parametrize("source", LAYOUTS)
def test_saved_in_one_placement_restores_bit_identically_in_every_placement(source, fmt, tmp_path):
    _, placement, params = placed(source, fmt)
    save_params(tmp_path / "ckpt", params, placement)
    for target in LAYOUTS:
        config, placement, expected = placed(target, fmt)
        assert_identical(restore_params(tmp_path / "ckpt", config, placement), expected)


def half_of(value, i: int):
    """Gate (i = 0) or up (1) of a gate_up parameter, as format 2 stored it apart."""
    take = lambda a: a[..., i::2]
    if isinstance(value, QuantizedArray):
        ts = None if value.tensor_scale is None else value.tensor_scale[..., i : i + 1]  # one per matrix
        return value.replace(values=take(value.values), scales=take(value.scales), tensor_scale=ts)
    return take(value)


@pytest.mark.parametrize("fmt", MODELS)
def test_format_2_checkpoint_of_gate_and_up_apart_restores_the_same_parameters(fmt, tmp_path):
    config, placement, params = placed("hybrid", fmt)  # 12 or 16 experts on ep=4: no padding
    manifest = Manifest(config.model, platform.run_dtype(config.engine.dtype), config.weights.expert_format, version=2)
    names = orbax_io.named_specs(manifest)[0]
    values = dict(zip((k for k, _ in names), jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedArray))))
    old = dict(legacy.stored_names(names))
    assert {"layers.1.moe.experts.gate", "layers.1.moe.experts.up", "layers.0.mlp.gate"} <= set(old)
    assert not any(k.endswith("gate_up") for k in old)
    stored = [
        (
            k,
            orbax_io.to_stored(
                spec,
                half_of(values[k.rpartition(".")[0] + ".gate_up"], k.endswith(".up")) if k not in values else values[k],
                placement.k_slices(spec),
            ),
        )
        for k, spec in old.items()
    ]
    orbax_io.write(tmp_path / "ckpt", manifest, stored)
    assert read_manifest(tmp_path / "ckpt").version == 2
    for target in ("tensor_sliced", "expert_sharded"):
        config, placement, expected = placed(target, fmt)
        assert_identical(restore_params(tmp_path / "ckpt", config, placement), expected)


# ----------------------------------------------------------------------------- interrupted saves

KILL_AFTER_TENSORS = """
import os, signal, sys
import checkpoints.convert as convert
import checkpoints.orbax_io
checkpoints.orbax_io.GROUP_BYTES = 0  # many groups: the kill lands between two of them
stored, count = convert.to_stored, [0]
def dying(*args):  # the writer dies as if killed mid-save
    count[0] += 1
    if count[0] == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
    return stored(*args)
convert.to_stored = dying
convert.convert(sys.argv[1], sys.argv[2])
"""


def kill_convert_midway(hf: Path, ckpt: Path, after: int = 30) -> None:
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_TENSORS, str(hf), str(ckpt), str(after)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def restored_single_device(ckpt: Path):
    config = with_hf_model(Config(), None, str(ckpt)).validate()
    return load_params(config, make_placement(config), checkpoint=str(ckpt))


@pytest.mark.slow
def test_interrupted_save_leaves_the_previous_checkpoint_readable_and_says_so(converted, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    subprocess.run(["cp", "-r", str(converted), str(ckpt)], check=True)
    before = restored_single_device(ckpt)
    kill_convert_midway(GOLDEN, ckpt)
    capsys.readouterr()
    assert_identical(restored_single_device(ckpt), before)
    assert "interrupted save" in capsys.readouterr().err


@pytest.mark.slow
def test_next_save_removes_what_an_interrupted_save_left(converted, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    subprocess.run(["cp", "-r", str(converted), str(ckpt)], check=True)
    kill_convert_midway(GOLDEN, ckpt)
    rc, _, err = cli(["convert", "--hf", GOLDEN, "--out", ckpt, "--json"], capsys)
    assert rc == 0 and "left from an interrupted save" in err
    assert len(list(ckpt.glob("data-*"))) == 1


def test_interrupted_first_save_is_reported_not_restored(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    kill_convert_midway(GOLDEN, ckpt)
    rc, _, err = cli(["score", "--checkpoint", ckpt], capsys)
    assert rc == 2 and "interrupted save" in err and MANIFEST in err


# ----------------------------------------------------------------------------- damaged checkpoints


def _largest_data_file(ckpt: Path) -> Path:
    return max((p for p in ckpt.glob("data-*/*/ocdbt.process_0/d/*")), key=lambda p: p.stat().st_size)


def _edit_manifest(ckpt: Path, edit) -> None:
    doc = json.loads((ckpt / MANIFEST).read_text())
    edit(doc)
    (ckpt / MANIFEST).write_text(json.dumps(doc))


def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "manifest missing": (lambda c: (c / MANIFEST).unlink(), "moejax.json is missing"),
    "manifest not json": (lambda c: (c / MANIFEST).write_text("{"), "moejax.json: corrupted"),
    "other format version": (
        lambda c: _edit_manifest(c, lambda d: d.update(format_version=99)),
        f"format version 99, this moejax reads version {FORMAT_VERSION}",
    ),
    "layer-by-layer format of earlier versions": (
        lambda c: _edit_manifest(c, lambda d: d.update(format_version=1)),
        "convert it again from its transformers directory",
    ),
    "config not matching arrays": (
        lambda c: _edit_manifest(c, lambda d: d["model"].update(hidden_size=48)),
        "model config in moejax.json implies",
    ),
    "data file truncated": (lambda c: os.truncate(_largest_data_file(c), 100), "truncated"),
    "data file corrupted": (lambda c: _flip_bytes(_largest_data_file(c)), "corrupted (checksum"),
    "group deleted": (lambda c: subprocess.run(["rm", "-r", str(next(c.glob("data-*/0003")))], check=True), "missing"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_checkpoint_ends_in_one_line_naming_the_file(damage, converted, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    subprocess.run(["cp", "-r", str(converted), str(ckpt)], check=True)
    do, says = DAMAGE[damage]
    do(ckpt)
    rc, out, err = cli(["score", "--checkpoint", ckpt, "--prompt-ids", "1,2,3"], capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and str(ckpt) in err and says in err, err


def _missing_shard(hf: Path) -> None:
    from checkpoints.safetensors_io import SafetensorsDir

    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    names = sorted(SafetensorsDir(hf).keys())
    (hf / "model.safetensors").rename(hf / shards[0])
    index = {"weight_map": {n: shards[n == names[-1]] for n in names}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


def _edit_hf_config(hf: Path, **changes) -> None:
    doc = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(doc | changes))


HF_DAMAGE = {
    "missing shard": (_missing_shard, "shard model-00002-of-00002.safetensors listed in"),
    "unsupported architecture": (
        lambda hf: _edit_hf_config(hf, model_type="llama"),
        "unsupported architecture 'llama'",
    ),
    "truncated safetensors": (lambda hf: os.truncate(hf / "model.safetensors", 150_000), "truncated safetensors file"),
    "config not matching the tensors": (lambda hf: _edit_hf_config(hf, hidden_size=48), "config.json implies"),
}


@pytest.mark.parametrize("damage", HF_DAMAGE)
def test_damaged_transformers_directory_ends_in_one_line_and_writes_nothing(damage, tmp_path, capsys):
    hf = tmp_path / "hf"
    subprocess.run(["cp", "-r", str(GOLDEN), str(hf)], check=True)
    do, says = HF_DAMAGE[damage]
    do(hf)
    rc, out, err = cli(["convert", "--hf", hf, "--out", tmp_path / "ckpt"], capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and str(hf) in err and says in err, err
    assert not (tmp_path / "ckpt").exists()


def test_explicit_other_expert_format_is_refused(converted, capsys):
    rc, _, err = cli(["score", "--checkpoint", converted, "--expert-format", "nvfp4"], capsys)
    assert rc == 2 and "holds unquantized experts" in err
