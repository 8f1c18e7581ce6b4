"""gpt-oss (transformers GptOssForCausalLM) against transformers on a tiny random model:
attention sinks, sliding-window layers between full ones, q/k/v/o biases, a biased router,
expert biases, the clamped SwiGLU and YaRN rope; under every placement; and its released
MXFP4 experts, loaded bit for bit."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import numpy as np
import pytest
from hf_quantized import write_mxfp4
from hf_reference import build_hf_model, hf_greedy, hf_logits
from layouts import placement_layouts

from checkpoints import packing
from checkpoints.manifest import read_manifest
from checkpoints.orbax_io import restore_params
from moejax.cli import main
from moejax.config import Config, LayoutConfig, WeightsConfig, preset
from moejax.engine.engine import Engine
from moejax.launch.loading import load_params, with_hf_model
from moejax.model.params import param_specs
from moejax.model.transformer import layer_params

pytest.importorskip("torch")

PROMPT = [3, 17, 45, 2, 88, 61, 9, 30, 12]  # longer than the sliding window of 4
NEW = 10
LAYOUTS = placement_layouts(tensor_sliced=2)  # MXFP4 K-slices of 64 there


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt_oss")
    return build_hf_model("gpt_oss", directory), directory


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """The same kind of model with its experts in MXFP4, as gpt-oss is published."""
    directory = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    build_hf_model("gpt_oss", directory, seed=1)
    return write_mxfp4(directory), directory


@functools.cache
def loaded(directory: Path, layout: LayoutConfig = LayoutConfig()):
    from sharding import make_placement

    config = with_hf_model(Config(layout=layout), str(directory)).validate()
    placement = make_placement(config)
    return config, placement, load_params(config, placement, hf_dir=str(directory))


def moe_run_specs(c) -> dict:
    """The parameter specs of the first run of MoE layers."""
    return next(run["moe"] for run in param_specs(c)["layers"] if "moe" in run)


@functools.cache
def engine(directory: Path, layout: LayoutConfig = LayoutConfig()) -> Engine:
    config, placement, params = loaded(directory, layout)
    return Engine(config, params, placement)


@functools.cache
def generation(directory: Path, layout: LayoutConfig = LayoutConfig()):
    return engine(directory, layout).generate([PROMPT], NEW, return_logits=True)


def assert_close_relative(ours, ref, rel=1e-4):
    np.testing.assert_allclose(ours, ref, rtol=0, atol=rel * np.abs(ref).max())


def test_prefill_logits_match_transformers(gpt_oss):
    model, directory = gpt_oss
    assert_close_relative(engine(directory).score([PROMPT])[0], hf_logits(model, PROMPT))


def test_long_prompt_in_blocks_of_queries_matches_transformers(gpt_oss):
    """Blocks of queries skip the key blocks before their window and still count the sinks."""
    model, directory = gpt_oss
    prompt = (PROMPT * 34)[:300]
    assert_close_relative(engine(directory).score([prompt])[0], hf_logits(model, prompt))


def test_greedy_tokens_match_transformers(gpt_oss):
    model, directory = gpt_oss
    assert generation(directory).tokens[0] == hf_greedy(model, PROMPT, NEW)


def test_cached_decode_logits_equal_full_forward(gpt_oss):
    _, directory = gpt_oss
    gen = generation(directory)
    full = engine(directory).score([PROMPT + gen.tokens[0][:-1]])[0]
    assert_close_relative(gen.logits[:, 0], full[len(PROMPT) - 1 :], rel=1e-5)


# Tensor-parallel attention on 4 devices: the query heads and their sinks sliced 4 ways.
ATTENTION_TP = LayoutConfig(placement="expert_sharded", devices=4, attention="tp")


@pytest.mark.parametrize("layout", [*LAYOUTS, "attention_tp"])
def test_every_placement_gives_the_single_device_tokens(gpt_oss, layout):
    """Expert biases go through the placements; K-sliced ones add the down bias once."""
    _, directory = gpt_oss
    ref, got = generation(directory), generation(directory, LAYOUTS.get(layout, ATTENTION_TP))
    assert got.tokens == ref.tokens
    assert_close_relative(got.logits, ref.logits)


# ----------------------------------------------------------------------------- MXFP4 as released


def test_mxfp4_logits_match_transformers_on_the_dequantized_experts(released):
    model, directory = released
    config, _, _ = loaded(directory)
    assert config.weights.expert_format == "mxfp4"
    assert_close_relative(engine(directory).score([PROMPT])[0], hf_logits(model, PROMPT))


@pytest.mark.parametrize("layout", [None, *LAYOUTS])
def test_mxfp4_experts_are_the_files_bits_under_every_placement(released, layout):
    from safetensors.numpy import load_file

    _, directory = released
    _, placement, params = loaded(directory, LAYOUTS.get(layout, LayoutConfig()))
    tensors = load_file(str(directory / "model.safetensors"))
    down_slices = placement.k_slices(moe_run_specs(placement.config.model)["experts"]["down"])
    for layer in range(placement.config.model.num_layers):
        experts, pre = (
            layer_params(params, layer, placement.config.model)["moe"]["experts"],
            f"model.layers.{layer}.mlp.experts.",
        )
        for part, name, slices in (("gate_up", "gate_up_proj", 1), ("down", "down_proj", down_slices)):
            blocks, scales = tensors[pre + name + "_blocks"], tensors[pre + name + "_scales"]
            e, n = blocks.shape[:2]
            values = np.asarray(packing.to_disk(experts[part].values, slices))[:e]  # [E, K/2, N]
            np.testing.assert_array_equal(values, blocks.reshape(e, n, -1).transpose(0, 2, 1))
            np.testing.assert_array_equal(
                np.asarray(experts[part].scales)[:e].view(np.uint8), scales.transpose(0, 2, 1)
            )


def test_mxfp4_greedy_tokens_under_a_k_sliced_placement_match_transformers(released):
    model, directory = released
    assert generation(directory, LAYOUTS["hybrid"]).tokens[0] == hf_greedy(model, PROMPT, NEW)


@pytest.mark.slow
def test_mxfp4_convert_keeps_the_experts_4bit(released, tmp_path):
    _, directory = released
    assert main(["convert", "--hf", str(directory), "--out", str(tmp_path / "ckpt"), "--json"]) == 0
    assert read_manifest(tmp_path / "ckpt").expert_format == "mxfp4"
    config, placement, params = loaded(directory, LAYOUTS["tensor_sliced"])
    for a, b in zip(jax.tree.leaves(restore_params(tmp_path / "ckpt", config, placement)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("layout", ["hybrid", "expert_sharded"])
def test_random_preset_quantizes_expert_matrices_and_keeps_their_biases(layout):
    """tiny-gpt-oss with MXFP4 experts quantized on load: the matrices 4-bit, the biases floats
    of the placement's padded expert count, equal to the single device's."""
    import pallas_kernels
    from sharding import make_placement

    def experts(layout: LayoutConfig):
        config = Config(model=preset("tiny-gpt-oss"), layout=layout, weights=WeightsConfig("mxfp4")).validate()
        return layer_params(load_params(config, make_placement(config), seed=3), 1, config.model)["moe"]["experts"]

    single, placed = experts(LayoutConfig()), experts(LAYOUTS[layout])
    assert all(isinstance(placed[p], pallas_kernels.QuantizedArray) for p in ("gate_up", "down"))
    for name in ("gate_up_bias", "down_bias"):
        np.testing.assert_array_equal(np.asarray(placed[name]), np.asarray(single[name]))
