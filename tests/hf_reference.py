"""Tiny random transformers models, one per family, built by the tests themselves.

Weights are drawn with a large std (0.2) and the router correction biases and attention
biases are randomised: at transformers' defaults logits are nearly flat and greedy ties
make token comparisons a coin toss.
"""

from __future__ import annotations

from pathlib import Path

FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3")
# GLM-5 (MLA + DSA indexer) is tested step by step in test_glm5.py: near-ties in the indexer's
# top-k make a full forward and a cached one differ in transformers itself.
GLM5 = "glm_moe_dsa"


def hf_config(family: str):
    import transformers

    common = dict(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        initializer_range=0.2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if family == "mixtral":
        return transformers.MixtralConfig(
            **common,
            num_key_value_heads=2,
            intermediate_size=16,
            num_local_experts=8,
            num_experts_per_tok=2,
        )
    if family == "glm4_moe":
        return transformers.Glm4MoeConfig(
            **common,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.5,
            attention_bias=True,
            use_qk_norm=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **common,
            num_key_value_heads=4,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        )
    if family == GLM5:
        # index_topk below the sequence length so the indexer's selection matters; layer 2
        # shares layer 1's selection. Eight indexer heads make all-zero (relu) score ties rare.
        return transformers.GlmMoeDsaConfig(
            **common,
            num_key_value_heads=4,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            mlp_layer_types=["dense", "sparse", "sparse"],
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            index_topk=6,
            index_head_dim=16,
            index_n_heads=8,
            indexer_types=["full", "full", "shared"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if family == "gpt_oss":
        # Experts of 128 (MXFP4 blocks of 32 fit each half of a K-slice over 2 devices); a
        # window of 4 under the test prompts' length; a low swiglu_limit so the clamps bite.
        return transformers.GptOssConfig(
            **common | {"hidden_size": 64},
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=4,
            swiglu_limit=1.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        )
    raise ValueError(family)


def build_hf_model(family: str, directory: Path, seed: int = 0, config=None):
    """A random transformers model (of `config`, default the family's) saved to `directory`
    (save_pretrained); returns the model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = hf_config(family) if config is None else config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.2)
        for name, p in model.named_parameters():
            if name.endswith((".bias", "_bias")):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(directory)
    return model


def hf_logits(model, tokens: list[int]):
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def hf_greedy(model, tokens: list[int], n: int, return_logits: bool = False):
    """transformers' cached greedy generate: n new tokens (and with `return_logits` the
    logits [n, V] each was chosen from)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([tokens]),
            max_new_tokens=n,
            do_sample=False,
            min_new_tokens=n,
            pad_token_id=0,
            eos_token_id=None,
            return_dict_in_generate=True,
            output_logits=True,
        )
    new = out.sequences[0, len(tokens) :].tolist()
    return (new, torch.stack(out.logits)[:, 0].numpy()) if return_logits else new
