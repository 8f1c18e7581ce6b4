"""config.json files written as the releases write them (keys, spelling and nesting of
DeepSeek-V3, GLM-5, GLM-4.5, Qwen3-30B-A3B, Mixtral-8x7B-v0.1 and gpt-oss-20b), shrunk to tiny
sizes: never re-saved by transformers, which would rewrite the rope as `rope_parameters`.

Sizes are tiny and `initializer_range` is raised to 0.2 (releases say 0.02) so random logits
are not flat; every other key keeps the release's value and spelling.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_MLA = {
    "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "num_attention_heads": 4,
    "num_key_value_heads": 4, "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8, "v_head_dim": 8, "vocab_size": 96, "initializer_range": 0.2,
}

RELEASES = {
    # deepseek-ai/DeepSeek-V3 (and R1; Kimi-K2 writes its rope alike): rope_scaling with "type", rope_theta outside.
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                     "AutoModel": "modeling_deepseek.DeepseekV3Model",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "hidden_act": "silu",
        "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_layer_freq": 1, "n_group": 4,
        "norm_topk_prob": True, "num_nextn_predict_layers": 1, "pretraining_tp": 1, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 2, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1", "use_cache": True, **TINY_MLA,
    },
    # zai-org/GLM-5: transformers 5's rope_parameters, DeepSeek's router keys, the DSA indexer.
    "glm_moe_dsa": {
        "architectures": ["GlmMoeDsaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "dtype": "bfloat16", "eos_token_id": [1, 2], "ep_size": 1, "head_dim": 8, "hidden_act": "silu",
        "index_head_dim": 16, "index_n_heads": 8, "index_topk": 6, "indexer_rope_interleave": True,
        "max_position_embeddings": 202752, "model_type": "glm_moe_dsa", "moe_layer_freq": 1, "n_group": 1,
        "norm_topk_prob": True, "num_nextn_predict_layers": 1, "pad_token_id": 3, "pretraining_tp": 1,
        "qk_head_dim": 16, "rms_norm_eps": 1e-05, "rope_interleave": True,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc",
        "transformers_version": "5.0.2.dev0", "use_cache": True, **TINY_MLA,
    },
    # zai-org/GLM-4.5: partial_rotary_factor at the top level, "rope_scaling": null.
    "glm4_moe": {
        "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "pad_token_id": 3, "eos_token_id": [1, 2], "head_dim": 8, "hidden_act": "silu", "hidden_size": 32,
        "partial_rotary_factor": 0.5, "initializer_range": 0.2, "intermediate_size": 48,
        "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 16,
        "norm_topk_prob": True, "num_attention_heads": 4, "n_group": 1, "topk_group": 1, "n_routed_experts": 8,
        "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "num_hidden_layers": 3, "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.54.0", "use_cache": True, "use_qk_norm": True,
        "vocab_size": 96,
    },
    # Qwen/Qwen3-30B-A3B, with the yarn its model card adds for long context ("rope_type" inside rope_scaling).
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "decoder_sparse_step": 1, "eos_token_id": 2, "head_dim": 8, "hidden_act": "silu",
        "hidden_size": 32, "initializer_range": 0.2, "intermediate_size": 48, "max_position_embeddings": 40960,
        "max_window_layers": 3, "mlp_only_layers": [1], "model_type": "qwen3_moe", "moe_intermediate_size": 16,
        "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "num_hidden_layers": 3, "num_key_value_heads": 2, "output_router_logits": False, "rms_norm_eps": 1e-06,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 96,
    },
    # mistralai/Mixtral-8x7B-v0.1: no head_dim, no rope mapping at all.
    "mixtral": {
        "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.2, "intermediate_size": 16,
        "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 4,
        "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 2, "num_local_experts": 8,
        "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 96,
    },
    # openai/gpt-oss-20b (its experts unquantized here): yarn under rope_scaling, "truncate": false.
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 2, "experts_per_token": 2, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
        "initial_context_length": 4096, "initializer_range": 0.2, "intermediate_size": 64,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 4,
        "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 2, "num_local_experts": 8,
        "output_router_logits": False, "pad_token_id": 3, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 4, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True,
        "vocab_size": 96,
    },
}


def write_release(family: str, directory: Path, seed: int = 0, **changes):
    """A random tiny model of `family` in `directory`: the release-style config.json (with
    `changes`), safetensors from transformers. Returns transformers' model loaded from that directory."""
    import torch
    import transformers

    from hf_reference import build_hf_model

    doc = RELEASES[family] | changes
    (directory / "config.json").write_text(json.dumps(doc, indent=2))
    config = transformers.AutoConfig.from_pretrained(directory)
    build_hf_model(family, directory, seed, config=config)  # writes its own config.json: put the release's back
    (directory / "config.json").write_text(json.dumps(doc, indent=2))
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
