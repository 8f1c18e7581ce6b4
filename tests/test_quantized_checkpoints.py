"""Quantized checkpoints as published (FP8 block-scaled, NVFP4 by ModelOpt): written here from a
tiny random transformers model, read by moejax, checked against transformers run on the
weights the files stand for; 4-bit experts bit for bit; anything else refused in one line."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from hf_quantized import nvfp4_dequantize, write_fp8, write_nvfp4
from hf_reference import build_hf_model, hf_config, hf_greedy, hf_logits
from layouts import placement_layouts

import pallas_kernels
from checkpoints import packing
from checkpoints.manifest import read_manifest
from checkpoints.orbax_io import restore_params
from moejax.cli import main
from moejax.config import Config, LayoutConfig, WeightsConfig
from moejax.engine.engine import Engine
from moejax.launch.loading import load_params, with_hf_model
from moejax.model.params import param_specs
from moejax.model.transformer import layer_params
from sharding import make_placement

pytest.importorskip("torch")

PROMPT = [3, 17, 45, 2, 88, 61, 9, 30, 12]
# Blocks that do not divide the matrices: partial edge blocks, as real shapes have with 128.
FP8_BLOCK = (16, 24)
# Every placement; tensor_sliced on 2 devices and hybrid 4 x 2 slice the experts' K (down
# projections) into halves of 32, whole NVFP4 block pairs.
LAYOUTS = placement_layouts(tensor_sliced=2)


def cli(argv: list, capsys) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def tiny_config():
    """Qwen3-MoE (per-expert tensors, a dense layer) with experts of 64: NVFP4 blocks fit."""
    config = hf_config("qwen3_moe")
    config.moe_intermediate_size = 64
    return config


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fp8")
    build_hf_model("qwen3_moe", directory, config=tiny_config())
    return write_fp8(directory, FP8_BLOCK), directory


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory):
    directory = tmp_path_factory.mktemp("nvfp4")
    build_hf_model("qwen3_moe", directory, config=tiny_config())
    return write_nvfp4(directory, exclude=("model.layers.0.self_attn*",)), directory


@functools.cache
def loaded(directory: Path, layout: LayoutConfig = LayoutConfig(), fmt: str = "unquantized"):
    config = with_hf_model(Config(layout=layout, weights=WeightsConfig(fmt)), str(directory)).validate()
    placement = make_placement(config)
    return config, placement, load_params(config, placement, hf_dir=str(directory))


def moe_run_specs(c) -> dict:
    """The parameter specs of the first run of MoE layers."""
    return next(run["moe"] for run in param_specs(c)["layers"] if "moe" in run)


def layer_experts(load, layer: int) -> dict:
    config, _, params = load
    return layer_params(params, layer, config.model)["moe"]["experts"]


def engine(directory: Path, layout: LayoutConfig = LayoutConfig()) -> Engine:
    config, placement, params = loaded(directory, layout)
    return Engine(config, params, placement)


def assert_close_relative(ours, ref, rel=1e-4):
    np.testing.assert_allclose(ours, ref, rtol=0, atol=rel * np.abs(ref).max())


def host(tree):
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


# ----------------------------------------------------------------------------- FP8 block-scaled


def test_fp8_logits_match_transformers_on_the_dequantized_weights(fp8):
    model, directory = fp8
    assert_close_relative(engine(directory).score([PROMPT])[0], hf_logits(model, PROMPT))


@pytest.mark.slow
def test_fp8_generate_gives_transformers_greedy_tokens(fp8, capsys):
    model, directory = fp8
    rc, out, _ = cli(
        ["generate", "--hf", directory, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", 12, "--json"],
        capsys,
    )
    assert rc == 0 and json.loads(out)["tokens"] == [hf_greedy(model, PROMPT, 12)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_loads_the_same_weights_under_every_placement(fp8, layout):
    _, directory = fp8
    single = loaded(directory)[2]
    for a, b in zip(host(single), host(loaded(directory, LAYOUTS[layout])[2])):  # 8 experts: no padding
        np.testing.assert_array_equal(a, b)


def test_fp8_experts_go_straight_to_4bit(fp8):
    """--expert-format nvfp4: the dequantized FP8 experts, quantized as on any load."""
    _, directory = fp8
    floats = layer_experts(loaded(directory), 0)
    four = layer_experts(loaded(directory, fmt="nvfp4"), 0)
    for part in ("gate_up", "down"):
        expected = pallas_kernels.quantize_experts(floats[part], "nvfp4", gated=part == "gate_up")
        for a, b in zip(host(four[part]), host(expected)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_fp8_converts_to_a_checkpoint_of_the_same_weights(fp8, tmp_path, capsys):
    _, directory = fp8
    rc, _, _ = cli(["convert", "--hf", directory, "--out", tmp_path / "ckpt", "--json"], capsys)
    config, placement, params = loaded(directory)
    assert rc == 0
    for a, b in zip(host(restore_params(tmp_path / "ckpt", config, placement)), host(params)):
        np.testing.assert_array_equal(a, b)


def test_fp8_128x128_blocks_scale_each_block_by_its_own_scale(tmp_path):
    """DeepSeek's blocks on a matrix they do not divide: element (i, j) takes scale (i // 128, j // 128)."""
    import torch
    from safetensors.torch import save_file

    from checkpoints.quantization import Tensors

    rng = np.random.default_rng(0)
    q = torch.from_numpy(rng.normal(size=(300, 200)).astype(np.float32)).to(torch.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, size=(3, 2)).astype(np.float32)
    save_file({"w.weight": q, "w.weight_scale_inv": torch.from_numpy(scale)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    )
    expected = q.float().numpy() * scale[np.arange(300)[:, None] // 128, np.arange(200)[None, :] // 128]
    np.testing.assert_array_equal(Tensors(tmp_path).get("w.weight"), expected)


# ----------------------------------------------------------------------------- refusals


def _edit_config(directory: Path, **changes) -> None:
    doc = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(doc | changes))


def _rewrite_tensor(directory: Path, name: str, value) -> None:
    """Replaces (value: an array) or drops (None) one tensor of the single safetensors file."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    if value is None:
        del tensors[name]
    else:
        tensors[name] = value
    save_file(tensors, str(directory / "model.safetensors"))


def _torch_zeros(*shape):
    import torch

    return torch.zeros(shape)


SCALE = "model.layers.0.self_attn.q_proj.weight_scale_inv"
NVFP4_SCALE = "model.layers.2.mlp.experts.5.up_proj.weight_scale"
REFUSED = {  # case: (what to damage, how, what the one line says); fp8 unless named nvfp4
    "weight_scale_inv missing": (lambda d: _rewrite_tensor(d, SCALE, None), f"tensor {SCALE} is missing"),
    "weight_scale_inv mis-shaped": (
        lambda d: _rewrite_tensor(d, SCALE, _torch_zeros(1, 1)),
        f"tensor {SCALE} has shape [1, 1], expected [2, 2]",
    ),
    "unknown quant_method": (
        lambda d: _edit_config(d, quantization_config={"quant_method": "gptq", "bits": 4}),
        "quant_method 'gptq' is not read",
    ),
    "fp8 without block scales": (
        lambda d: _edit_config(d, quantization_config={"quant_method": "fp8"}),
        "per-tensor FP8",
    ),
    "F8_E4M3 without a quantization_config": (
        lambda d: _edit_config(d, quantization_config=None),
        "has dtype F8_E4M3, which moejax does not read here",
    ),
    "ModelOpt FP8": (
        lambda d: (
            _edit_config(d, quantization_config=None),
            (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}})),
        ),
        "ModelOpt quant_algo 'FP8' is not read",
    ),
    "nvfp4 weight_scale_2 missing": (
        lambda d: _rewrite_tensor(d, NVFP4_SCALE + "_2", None),
        f"tensor {NVFP4_SCALE}_2 is missing",
    ),
    "nvfp4 weight_scale mis-shaped": (
        lambda d: _rewrite_tensor(d, NVFP4_SCALE, _torch_zeros(64, 1)),
        f"tensor {NVFP4_SCALE} has shape [64, 1], expected [64, 2]",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unreadable_quantization_ends_in_one_line(case, request, tmp_path, capsys):
    directory = tmp_path / "hf"
    shutil.copytree(request.getfixturevalue("nvfp4" if case.startswith("nvfp4") else "fp8")[1], directory)
    do, says = REFUSED[case]
    do(directory)
    capsys.readouterr()  # a fixture built just now printed transformers' progress
    rc, out, err = cli(["score", "--hf", directory, "--prompt-ids", "1,2,3"], capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and says in err, err


# ----------------------------------------------------------------------------- NVFP4 (ModelOpt)


def gate_and_up(experts: dict) -> dict:
    """gate_up's gate and up halves (each leaf's columns de-interleaved), beside down."""
    halves = {
        name: jax.tree.map(lambda a, i=i: a[..., i::2], experts["gate_up"]) for i, name in enumerate(("gate", "up"))
    }
    return {**halves, "down": experts["down"]}


def file_experts(directory: Path, layer: int, part: str):
    """The file's NVFP4 experts of one layer: (codes [E, in/2, out] as stored, transposed;
    scales [E, in/16, out]; weight_scale_2 [E]; dequantized [E, in, out])."""
    import ml_dtypes
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(directory / "model.safetensors"))
    e = hf_config("qwen3_moe").num_experts
    pre = [f"model.layers.{layer}.mlp.experts.{i}.{part}_proj.weight" for i in range(e)]
    w = [tensors[p].numpy() for p in pre]
    s = [tensors[p + "_scale"].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn) for p in pre]
    s2 = [tensors[p + "_scale_2"].numpy() for p in pre]
    deq = np.stack([nvfp4_dequantize(*args).T for args in zip(w, s, s2)])
    return np.stack([x.T for x in w]), np.stack([x.T for x in s]), np.stack(s2), deq


def test_nvfp4_logits_match_transformers_on_the_dequantized_weights(nvfp4):
    model, directory = nvfp4
    config, _, _ = loaded(directory)
    assert config.weights.expert_format == "nvfp4"
    assert_close_relative(engine(directory).score([PROMPT])[0], hf_logits(model, PROMPT))


@pytest.mark.parametrize("layout", [None, *LAYOUTS])
def test_nvfp4_experts_are_the_files_bits_under_every_placement(nvfp4, layout):
    """Values repacked to the file's byte pairs, scales and weight_scale_2 are the file's bytes;
    dequantized (whole experts), they are the file's values exactly."""
    _, directory = nvfp4
    _, placement, params = loaded(directory, LAYOUTS.get(layout, LayoutConfig()))
    spec_down = moe_run_specs(placement.config.model)["experts"]["down"]
    for layer in (0, 2):
        experts = gate_and_up(layer_params(params, layer, placement.config.model)["moe"]["experts"])
        for part in ("gate", "up", "down"):
            q = experts[part]
            codes, scales, scale_2, deq = file_experts(directory, layer, part)
            e = codes.shape[0]
            slices = placement.k_slices(spec_down) if part == "down" else 1
            np.testing.assert_array_equal(np.asarray(packing.to_disk(q.values, slices))[:e], codes)
            np.testing.assert_array_equal(np.asarray(q.scales)[:e].view(np.uint8), scales.view(np.uint8))
            np.testing.assert_array_equal(np.asarray(q.tensor_scale)[:e, 0, 0], scale_2)
            if slices == 1:
                np.testing.assert_array_equal(np.asarray(pallas_kernels.dequantize(q))[:e], deq)


def test_nvfp4_greedy_tokens_under_a_k_sliced_placement_match_transformers(nvfp4):
    model, directory = nvfp4
    got = engine(directory, LAYOUTS["hybrid"]).generate([PROMPT], 12).tokens[0]
    assert got == hf_greedy(model, PROMPT, 12)


@pytest.mark.slow
def test_nvfp4_convert_keeps_the_experts_4bit(nvfp4, tmp_path, capsys):
    _, directory = nvfp4
    rc, out, _ = cli(["convert", "--hf", directory, "--out", tmp_path / "ckpt", "--json"], capsys)
    assert rc == 0 and json.loads(out)["expert_format"] == "nvfp4"
    assert read_manifest(tmp_path / "ckpt").expert_format == "nvfp4"
    config, placement, params = loaded(directory, LAYOUTS["hybrid"])
    for a, b in zip(host(restore_params(tmp_path / "ckpt", config, placement)), host(params)):
        np.testing.assert_array_equal(a, b)


def test_nvfp4_experts_refuse_another_4bit_format(nvfp4, capsys):
    rc, _, err = cli(["score", "--hf", nvfp4[1], "--expert-format", "mxfp4"], capsys)
    assert rc == 2 and "holds nvfp4 experts, not mxfp4" in err
