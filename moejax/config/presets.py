"""Named models: tiny ones that run in seconds on CPU, the benchmark model, and full-size
ones for `calc`, `plan` and abstract evaluation."""

from __future__ import annotations

from moejax.config.errors import ConfigError
from moejax.config.schema import ModelConfig

def _tiny_mla(**kw) -> ModelConfig:
    base = dict(
        family="deepseek_v3", vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=512,
        num_layers=3, num_heads=8, num_kv_heads=8, head_dim=8, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True, num_experts=16,
        num_experts_per_tok=4, num_shared_experts=1, router_scoring="sigmoid", router_bias=True,
        routed_scaling_factor=2.5, n_group=4, topk_group=2, dense_layers=(0,), initializer_range=0.2,
        max_position_embeddings=2048,
    )
    base.update(kw)
    return ModelConfig(**base)


PRESETS: dict[str, ModelConfig] = {
    # The default: DeepSeek-V3 / GLM shaped (MLA, shared expert, sigmoid grouped router), seconds on CPU.
    "tiny": _tiny_mla(),
    # GLM-5 shaped: MLA + DSA indexer (layer 2 shares layer 1's selection), 32 experts top-8.
    "tiny-glm-5.3": _tiny_mla(
        family="glm_moe_dsa", num_experts=32, num_experts_per_tok=8, n_group=1, topk_group=1, num_layers=4,
        dense_layers=(0,), index_topk=8, index_head_dim=16, index_n_heads=4, dsa_shared_layers=(2,),
    ),
    "tiny-qwen3-moe": ModelConfig(
        family="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, dense_layers=(1,), initializer_range=0.2,
        rope_theta=1e6,
    ),
    "tiny-mixtral": ModelConfig(
        family="mixtral", vocab_size=512, hidden_size=64, moe_intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        initializer_range=0.2, rms_norm_eps=1e-5, rope_theta=1e6,
    ),
    "tiny-glm4-moe": ModelConfig(
        family="glm4_moe", vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, partial_rotary_factor=0.5,
        attention_bias=True, qk_norm=True, num_experts=16, num_experts_per_tok=4, num_shared_experts=1,
        router_scoring="sigmoid", router_bias=True, routed_scaling_factor=1.5, n_group=1, topk_group=1,
        dense_layers=(0,), initializer_range=0.2, rms_norm_eps=1e-5,
    ),
    "tiny-gpt-oss": ModelConfig(
        family="gpt_oss", vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=128,
        num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True, o_bias=True,
        attention_sinks=True, sliding_window=4, sliding_layers=(0, 2), num_experts=16, num_experts_per_tok=4,
        router_scoring="topk_softmax", router_bias=True, norm_topk_prob=False, expert_bias=True,
        expert_act="clamped_swiglu", swiglu_limit=1.0, initializer_range=0.2, rms_norm_eps=1e-5, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
                      "beta_slow": 1.0, "truncate": False},
        max_position_embeddings=2048,
    ),
    # Mid-size model of the benchmark (benchmarks/model_vs_transformers.py): Qwen3-MoE geometry scaled down.
    "bench-qwen3-moe": ModelConfig(
        family="qwen3_moe", vocab_size=32000, hidden_size=1024, intermediate_size=2048,
        moe_intermediate_size=256, num_layers=4, num_heads=16, num_kv_heads=4, head_dim=64, qk_norm=True,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1e6,
    ),
    # Full-size models: for `calc` and abstract evaluation, not for running on CPU.
    "glm-5.3": ModelConfig(
        family="glm_moe_dsa", vocab_size=154880, hidden_size=6144, intermediate_size=12288,
        moe_intermediate_size=2048, num_layers=78, num_heads=64, num_kv_heads=64, head_dim=64,
        q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
        rope_interleave=True, num_experts=256, num_experts_per_tok=8, num_shared_experts=1,
        router_scoring="sigmoid", router_bias=True, routed_scaling_factor=2.5, n_group=1, topk_group=1,
        dense_layers=(0, 1, 2), rms_norm_eps=1e-5, max_position_embeddings=202752,
        index_topk=2048, index_head_dim=128, index_n_heads=32,
    ),
    "deepseek-v3": ModelConfig(
        family="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_layers=61, num_heads=128, num_kv_heads=128, head_dim=64,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_interleave=True, num_experts=256, num_experts_per_tok=8, num_shared_experts=1,
        router_scoring="sigmoid", router_bias=True, routed_scaling_factor=2.5, n_group=8, topk_group=4,
        dense_layers=(0, 1, 2), max_position_embeddings=163840,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
    "qwen3-moe-30b-a3b": ModelConfig(
        family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1e6,
        max_position_embeddings=40960,
    ),
    "mixtral-8x7b": ModelConfig(
        family="mixtral", vocab_size=32000, hidden_size=4096, moe_intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, num_experts=8, num_experts_per_tok=2,
        rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=32768,
    ),
}
PRESETS["tiny-deepseek-v3"] = PRESETS["tiny"]
PRESETS["tiny-glm5"] = PRESETS["tiny-glm-5.3"]


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
