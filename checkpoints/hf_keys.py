"""Every `config.json` key the supported families' releases carry, and what moejax does with it.

Each key is read (`hf_config.from_hf_config` turns it into `ModelConfig` fields), known not to
change what inference computes (ignored), or asks for math whose other values moejax does not
compute (`Asks`: refused in one line unless its value is one of `allowed`). A key in no table is
refused: a setting silently dropped is a model silently changed.
"""

from __future__ import annotations

import dataclasses

from moejax.config import ConfigError

READ, IGNORED = "read", "ignored"


@dataclasses.dataclass(frozen=True)
class Asks:
    allowed: tuple  # the values moejax computes
    what: str  # what another value asks for


# transformers' bookkeeping, generation defaults and training-only settings, in every family.
BOOKKEEPING = dict.fromkeys(
    (
        "architectures",
        "auto_map",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "output_router_logits",
        "router_aux_loss_coef",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
        "tokenizer_class",
        "torchscript",
        "attention_dropout",  # dropout is off at inference
    ),
    IGNORED,
) | {"quantization_config": READ}  # by `checkpoints.quantization`

COMMON = dict.fromkeys(
    (
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "num_experts_per_tok",
        "rms_norm_eps",
        "tie_word_embeddings",
        "max_position_embeddings",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "initializer_range",  # random initialisation only
    ),
    READ,
) | {"hidden_act": Asks(("silu",), "another MLP activation")}

WHOLE_ROPE = {"partial_rotary_factor": Asks((1.0,), "a partial rotary embedding, which this family's code has not")}

# DeepSeek-V3's MLA and sigmoid grouped router, as GLM-5 reuses them.
MLA = (
    dict.fromkeys(
        (
            "intermediate_size",
            "moe_intermediate_size",
            "n_routed_experts",
            "n_shared_experts",
            "routed_scaling_factor",
            "n_group",
            "topk_group",
            "first_k_dense_replace",
            "norm_topk_prob",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ),
        READ,
    )
    | dict.fromkeys(
        (
            "head_dim",
            "qk_head_dim",  # derived: transformers sets them from qk_rope_head_dim and qk_nope_head_dim
            "num_nextn_predict_layers",
            "num_mtp_layers",  # the MTP module is found by its tensors
            "aux_loss_alpha",
            "seq_aux",
            "ep_size",
            "pretraining_tp",  # training and parallelism of the original code
        ),
        IGNORED,
    )
    | WHOLE_ROPE
    | {
        "scoring_func": Asks(("sigmoid",), "another router scoring"),
        "topk_method": Asks(("noaux_tc",), "another expert selection"),
        "moe_layer_freq": Asks((1,), "MoE layers at another interval"),
        "attention_bias": Asks((False,), "biases on the MLA projections"),
    }
)

KEYS: dict[str, dict[str, str | Asks]] = {
    "deepseek_v3": BOOKKEEPING | COMMON | MLA | {"rope_interleave": READ},
    "glm_moe_dsa": BOOKKEEPING
    | COMMON
    | MLA
    | dict.fromkeys(
        (
            "index_topk",
            "index_head_dim",
            "index_n_heads",
            "indexer_types",
            "index_topk_pattern",
            "index_topk_freq",
            "index_skip_topk_offset",
            "mlp_layer_types",
        ),
        READ,
    )
    | {
        "layer_types": IGNORED,  # every layer is DSA; transformers picks its cache class by it
        "rope_interleave": Asks((True,), "non-interleaved rope, which the GLM-5 code has not"),
        "indexer_rope_interleave": Asks((True,), "a non-interleaved indexer rope"),
        "mlp_bias": Asks((False,), "biases on the MLPs"),
    },
    "glm4_moe": BOOKKEEPING
    | COMMON
    | dict.fromkeys(
        (
            "head_dim",
            "intermediate_size",
            "moe_intermediate_size",
            "n_routed_experts",
            "n_shared_experts",
            "routed_scaling_factor",
            "n_group",
            "topk_group",
            "first_k_dense_replace",
            "norm_topk_prob",
            "attention_bias",
            "use_qk_norm",
            "partial_rotary_factor",
        ),
        READ,
    )
    | dict.fromkeys(("num_nextn_predict_layers", "num_mtp_layers", "pretraining_tp"), IGNORED),
    "qwen3_moe": BOOKKEEPING
    | COMMON
    | WHOLE_ROPE
    | dict.fromkeys(
        (
            "head_dim",
            "intermediate_size",
            "moe_intermediate_size",
            "num_experts",
            "num_local_experts",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
            "attention_bias",
        ),
        READ,
    )
    | dict.fromkeys(
        (
            "sliding_window",
            "max_window_layers",  # read by transformers only with use_sliding_window
        ),
        IGNORED,
    )
    | {"use_sliding_window": Asks((False,), "sliding-window attention in Qwen3-MoE")},
    "mixtral": BOOKKEEPING
    | COMMON
    | WHOLE_ROPE
    | dict.fromkeys(
        (
            "head_dim",
            "intermediate_size",
            "num_local_experts",
            "sliding_window",
        ),
        READ,
    )
    | {"router_jitter_noise": IGNORED},  # training only
    "gpt_oss": BOOKKEEPING
    | COMMON
    | WHOLE_ROPE
    | dict.fromkeys(
        (
            "head_dim",
            "intermediate_size",
            "num_local_experts",
            "sliding_window",
            "layer_types",
            "attention_bias",
            "swiglu_alpha",
            "swiglu_limit",
            "experts_per_token",
        ),
        READ,
    )
    | {"initial_context_length": IGNORED},  # yarn reads original_max_position_embeddings
}


def check_keys(hf: dict) -> None:
    """One line for the first key of `hf` that moejax would drop or could not compute."""
    family = hf.get("model_type")
    table = KEYS[family]
    for key, value in hf.items():
        role = table.get(key, IGNORED if key.startswith("_") else None)  # _name_or_path and the like
        if role is None:
            raise ConfigError(
                f"config.json key {key!r} is not one moejax reads for {family}; it may change "
                "the model, so moejax does not run it (remove the key if it does not)"
            )
        if isinstance(role, Asks) and value not in role.allowed:
            raise ConfigError(
                f"config.json {key} {value!r} asks for {role.what}, which moejax does not compute "
                f"(it computes {' or '.join(map(repr, role.allowed))})"
            )
