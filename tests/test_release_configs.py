"""Configs as the releases write them: every family's release-style config.json (not re-saved
by transformers), read by moejax and by transformers from the same file, gives transformers'
logits and greedy tokens, on one device and on several; every key moejax cannot compute is
refused in one line."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hf_quantized import write_fp8
from hf_reference import hf_greedy
from release_configs import RELEASES, write_release

from checkpoints.hf_config import FAMILY_DEFAULTS, from_hf_config
from moejax.cli import main
from moejax.config import Config, ConfigError, ModelConfig, read_rope
from moejax.engine.engine import Engine
from moejax.launch.loading import load_params, with_hf_model
from sharding import make_placement, names, with_placement

pytest.importorskip("torch")

PROMPT = [3, 17, 45, 2, 88, 61, 9, 30, 12]
NEW = 8
MULTI = ("expert_sharded", 4)  # the multi-device placement every family runs under


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """family -> (directory, transformers' greedy tokens, their logits [NEW, V])."""
    made = {}

    def make(family):
        if family not in made:
            directory = tmp_path_factory.mktemp(family)
            model = write_release(family, directory)
            made[family] = (directory, *hf_greedy(model, PROMPT, NEW, return_logits=True))
        return made[family]

    return make


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    """DeepSeek-V3 as released: the release config plus FP8 block-scaled linears."""
    directory = tmp_path_factory.mktemp("deepseek_fp8")
    write_release("deepseek_v3", directory)
    model = write_fp8(directory, (16, 24))
    return (directory, *hf_greedy(model, PROMPT, NEW, return_logits=True))


@functools.cache
def generated(directory: Path, placement: str = "", devices: int = 1):
    config = with_hf_model(Config(), str(directory))
    config = with_placement(config, placement, devices, ep=4, tp=2) if devices > 1 else config.validate()
    placement = make_placement(config)
    engine = Engine(config, load_params(config, placement, hf_dir=str(directory)), placement)
    return engine.generate([PROMPT], NEW, return_logits=True)


def assert_matches(gen, tokens, logits):
    assert gen.tokens[0] == tokens
    np.testing.assert_allclose(gen.logits[:, 0], logits, rtol=0, atol=1e-4 * np.abs(logits).max())


# ----------------------------------------------------------------------------- as published


@pytest.mark.parametrize("family", RELEASES)
def test_release_config_gives_transformers_logits_and_tokens_on_one_device(releases, family):
    directory, tokens, logits = releases(family)
    assert_matches(generated(directory), tokens, logits)


@pytest.mark.parametrize("family", [f for f in RELEASES if f != "deepseek_v3"])  # DeepSeek-V3: every placement, below
def test_release_config_gives_transformers_logits_and_tokens_on_several_devices(releases, family):
    directory, tokens, logits = releases(family)
    assert_matches(generated(directory, *MULTI), tokens, logits)


# Values moejax reads that the releases leave at their defaults: a window on every Mixtral
# layer; Qwen3-MoE's attention biases (q, k, v and o).
VARIANTS = {
    "mixtral window": ("mixtral", {"sliding_window": 4}),
    "qwen3_moe attention_bias": ("qwen3_moe", {"attention_bias": True}),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_read_values_the_releases_leave_at_default_match_transformers(variant, tmp_path):
    family, change = VARIANTS[variant]
    model = write_release(family, tmp_path, **change)
    tokens, logits = hf_greedy(model, PROMPT, NEW, return_logits=True)
    assert_matches(generated(tmp_path), tokens, logits)


@pytest.mark.parametrize("placement", names())
def test_deepseek_v3_release_matches_transformers_under_every_placement(releases, placement):
    directory, tokens, logits = releases("deepseek_v3")
    assert_matches(generated(directory, placement, 8), tokens, logits)


@pytest.mark.parametrize("placement", ["", *names()])
def test_deepseek_v3_fp8_release_matches_transformers_under_every_placement(deepseek_fp8, placement):
    directory, tokens, logits = deepseek_fp8
    assert_matches(generated(directory, placement, 8 if placement else 1), tokens, logits)


def test_deepseek_v3_release_takes_yarns_attention_scale():
    """The release's rope_scaling ("type": "yarn", mscale_all_dim 1) scales MLA's softmax by
    yarn_mscale(40, 1)^2, as DeepSeek's code does; the rope_type spelling reads the same."""
    c = from_hf_config(RELEASES["deepseek_v3"])
    respelled = dict(
        RELEASES["deepseek_v3"],
        rope_scaling=None,
        rope_parameters={**RELEASES["deepseek_v3"]["rope_scaling"], "rope_theta": 10000},
    )
    del respelled["rope_parameters"]["type"]
    respelled["rope_parameters"]["rope_type"] = "yarn"
    del respelled["rope_theta"]
    m = 0.1 * np.log(40) + 1
    assert c.softmax_scale == pytest.approx(16**-0.5 * m * m)
    assert from_hf_config(respelled).rope == c.rope and c.rope.kind == "yarn"


# ----------------------------------------------------------------------------- the rope, every spelling

YARN = {"factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.5}
SPELLINGS = {
    "rope_scaling, type, theta outside": ({"type": "yarn", **YARN}, 5e5, None),
    "rope_scaling, rope_type, theta outside": ({"rope_type": "yarn", **YARN}, 5e5, None),
    "rope_parameters, theta inside": ({"rope_type": "yarn", "rope_theta": 5e5, **YARN}, None, None),
    "theta both places alike": ({"rope_type": "yarn", "rope_theta": 5e5, **YARN}, 5e5, None),
    "partial inside": ({"rope_type": "yarn", "partial_rotary_factor": 1.0, **YARN}, 5e5, None),
    "partial outside": ({"type": "yarn", **YARN}, 5e5, 1.0),
}


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_spelling_of_a_rope_reads_alike(spelling):
    params, theta, partial = SPELLINGS[spelling]
    rope, got_partial = read_rope(params, theta, partial)
    assert rope == read_rope({"rope_type": "yarn", **YARN}, 5e5)[0] and got_partial == 1.0
    assert rope.theta == 5e5 and rope.mscale_all_dim == 0.5


@pytest.mark.parametrize("params", [None, {}, {"rope_type": "default"}, {"type": "default", "rope_theta": 7.0}])
def test_null_or_default_rope_is_plain_rope(params):
    rope, _ = read_rope(params, None if params and "rope_theta" in params else 7.0)
    assert (rope.kind, rope.theta, rope.cos_sin_scale, rope.mla_softmax_factor) == ("default", 7.0, 1.0, 1.0)


def test_absent_keys_take_the_familys_transformers_defaults():
    import transformers

    classes = {
        "deepseek_v3": "DeepseekV3Config",
        "glm_moe_dsa": "GlmMoeDsaConfig",
        "glm4_moe": "Glm4MoeConfig",
        "qwen3_moe": "Qwen3MoeConfig",
        "mixtral": "MixtralConfig",
        "gpt_oss": "GptOssConfig",
    }
    for family, defaults in FAMILY_DEFAULTS.items():
        reference = getattr(transformers, classes[family])()
        assert {k: getattr(reference, k) for k in defaults} == defaults, family


# ----------------------------------------------------------------------------- refused

ROPE_REFUSED = {  # rope mapping -> what the line says
    "longrope": ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "'longrope' is not computed"),
    "llama3": ({"rope_type": "llama3", "factor": 8.0}, "'llama3' is not computed"),
    "dynamic": ({"type": "dynamic", "factor": 2.0}, "'dynamic' is not computed"),
    "linear": ({"type": "linear", "factor": 2.0}, "'linear' is not computed"),
    "two types": ({"type": "yarn", "rope_type": "linear", "factor": 2.0}, "names two rope types"),
    "unknown yarn key": (
        {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "alpha": 1},
        "key 'alpha' is not one rope type 'yarn' reads",
    ),
    "theta given twice, differently": (
        {"type": "yarn", "factor": 2.0, "rope_theta": 5.0},
        "rope_theta is 1e+06 at the top level but 5 in",
    ),
    "per layer type": ({"full_attention": {"rope_type": "default"}}, "per-layer-type rope settings"),
}
REFUSED = {  # family, change to the release config -> what the line says
    "hidden_act gelu": ("mixtral", {"hidden_act": "gelu"}, "hidden_act 'gelu' asks for another MLP activation"),
    "scoring_func softmax": ("deepseek_v3", {"scoring_func": "softmax"}, "asks for another router scoring"),
    "topk_method greedy": ("deepseek_v3", {"topk_method": "greedy"}, "asks for another expert selection"),
    "moe_layer_freq 2": ("deepseek_v3", {"moe_layer_freq": 2}, "asks for MoE layers at another interval"),
    "MLA attention_bias": ("deepseek_v3", {"attention_bias": True}, "asks for biases on the MLA projections"),
    "partial rope on MLA": ("deepseek_v3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 asks for"),
    "partial rope inside": (
        "qwen3_moe",
        {"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.5}},
        "partial_rotary_factor 0.5 asks for a partial rotary embedding",
    ),
    "Qwen3 sliding window": ("qwen3_moe", {"use_sliding_window": True}, "asks for sliding-window attention"),
    "GLM-5 plain rope": ("glm_moe_dsa", {"rope_interleave": False}, "asks for non-interleaved rope"),
    "GLM-5 indexer rope": ("glm_moe_dsa", {"indexer_rope_interleave": False}, "non-interleaved indexer rope"),
    "GLM-5 mlp_bias": ("glm_moe_dsa", {"mlp_bias": True}, "asks for biases on the MLPs"),
    "gpt-oss experts_per_token": ("gpt_oss", {"experts_per_token": 4}, "experts_per_token 4 differs"),
    "gpt-oss layer_types": ("gpt_oss", {"layer_types": ["chunked_attention"] * 3}, "layer_types must name"),
    "both rope keys, differing": (
        "qwen3_moe",
        {"rope_parameters": {"rope_type": "default"}},
        "both rope_scaling and rope_parameters",
    ),
    "unknown key": ("qwen3_moe", {"use_mup": True}, "key 'use_mup' is not one moejax reads for qwen3_moe"),
    "unknown architecture": ("mixtral", {"model_type": "kimi_k2"}, "unsupported architecture 'kimi_k2'"),
} | {f"rope {name}": ("qwen3_moe", {"rope_scaling": params}, says) for name, (params, says) in ROPE_REFUSED.items()}


@pytest.mark.parametrize("case", REFUSED)
def test_a_key_moejax_cannot_compute_is_refused_in_one_line(case, tmp_path, capsys):
    """Refused from config.json alone, before any weight is read (the directory has none)."""
    family, change, says = REFUSED[case]
    (tmp_path / "config.json").write_text(json.dumps(RELEASES[family] | change))
    rc = main(["score", "--hf", str(tmp_path), "--prompt-ids", "1,2,3"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and says in err, err


def test_a_config_file_rope_moejax_cannot_compute_is_refused():
    with pytest.raises(ConfigError, match="'llama3' is not computed"):
        Config(model=ModelConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0})).validate()


# ----------------------------------------------------------------------------- 4-bit widths


def test_nvfp4_on_experts_too_narrow_for_it_is_one_line_before_loading(releases, capsys):
    """DeepSeek-V3 with moe_intermediate_size 24 on 8 devices: NVFP4 packs pairs of 16-value
    blocks along it. The directory's weights are still 16 wide: refused before they are read."""
    directory, _, _ = releases("deepseek_v3")
    narrow = directory.parent / "narrow"
    shutil.copytree(directory, narrow, dirs_exist_ok=True)
    (narrow / "config.json").write_text(json.dumps(RELEASES["deepseek_v3"] | {"moe_intermediate_size": 24}))
    capsys.readouterr()  # the fixture, built just now, printed transformers' progress
    rc = main(["score", "--hf", str(narrow), "--prompt-ids", "1,2,3", "--expert-format", "nvfp4", "--devices", "8"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "nvfp4 experts need moe_intermediate_size to be a multiple of 32" in err and "is 24" in err, err
