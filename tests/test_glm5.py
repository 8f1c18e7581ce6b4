"""GLM-5 (MLA + DSA indexer, `glm_moe_dsa`) against transformers' GlmMoeDsaForCausalLM.

Compared step by step (our cached decode against transformers' cached generate), with
`index_topk` below the sequence length so that the indexer's selection is exercised.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hf_reference import GLM5, build_hf_model, hf_greedy

from checkpoints.hf_config import from_hf_config
from moejax.config import Config, preset
from moejax.engine.engine import Engine
from moejax.launch.loading import load_params, with_hf_model
from sharding import make_placement

PROMPT = [3, 17, 45, 2, 88, 61, 9, 30, 12]


def _engine(config: Config, hf_dir) -> Engine:
    placement = make_placement(config)
    return Engine(config, load_params(config, placement, hf_dir=str(hf_dir)), placement)


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    pytest.importorskip("torch")
    directory = tmp_path_factory.mktemp(GLM5)
    model = build_hf_model(GLM5, directory)
    config = with_hf_model(Config(), str(directory)).validate()
    return model, directory, config, _engine(config, directory)


def test_config_import_reads_dsa_fields(glm5):
    _, _, config, _ = glm5
    c = config.model
    assert (c.family, c.index_topk, c.index_n_heads, c.index_head_dim) == ("glm_moe_dsa", 6, 8, 16)
    assert c.dsa_shared_layers == (2,) and c.dense_layers == (0,) and c.rope_interleave


def test_cached_decode_logits_and_greedy_tokens_match_transformers(glm5):
    model, _, _, engine = glm5
    tokens, logits = hf_greedy(model, PROMPT, 16, return_logits=True)
    gen = engine.generate([PROMPT], 16, return_logits=True)
    assert gen.tokens[0] == tokens
    np.testing.assert_allclose(gen.logits[:, 0], logits, rtol=0, atol=1e-4 * np.abs(logits).max())


def test_indexer_selection_changes_the_logits(glm5):
    """The comparison above is only meaningful if top-k selection actually drops keys."""
    _, directory, config, engine = glm5
    dense = dataclasses.replace(config, model=dataclasses.replace(config.model, index_topk=512))
    sparse_logits = engine.generate([PROMPT], 16, return_logits=True).logits
    dense_logits = _engine(dense, directory).generate([PROMPT], 16, return_logits=True).logits
    assert np.abs(sparse_logits - dense_logits).max() > 1e-2 * np.abs(dense_logits).max()


def test_glm53_preset_is_glm5_architecture():
    c = preset("glm-5.3")
    c.validate()
    assert c.is_dsa and c.is_mla and c.num_layers == 78 and c.num_experts == 256 and c.dense_layers == (0, 1, 2)
    assert (c.index_topk, c.index_n_heads, c.index_head_dim) == (2048, 32, 128)


def test_mlp_layer_types_beat_first_k_dense():
    hf = dict(
        model_type="glm_moe_dsa",
        vocab_size=8,
        hidden_size=8,
        num_hidden_layers=3,
        num_attention_heads=1,
        num_experts_per_tok=1,
        n_routed_experts=2,
        first_k_dense_replace=1,
        q_lora_rank=4,
        kv_lora_rank=4,
        qk_nope_head_dim=2,
        qk_rope_head_dim=2,
        v_head_dim=2,
        index_topk=2,
        index_head_dim=2,
        index_n_heads=1,
        mlp_layer_types=["dense", "sparse", "dense"],
        indexer_types=["full", "shared", "full"],
    )
    c = from_hf_config(hf)
    c.validate()
    assert c.dense_layers == (0, 2) and c.dsa_shared_layers == (1,)
