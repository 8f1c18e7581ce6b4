"""A `ModelConfig` from a transformers `config.json`, as the releases write it or as
transformers' `save_pretrained` does: every key read, ignored or refused by `hf_keys`, the
rope through `moejax.config.read_rope`, and each family's own defaults for what is not given."""

from __future__ import annotations

from checkpoints.hf_keys import check_keys
from moejax.config import ConfigError, ModelConfig, read_rope, replace_checked
from moejax.config.files import coerce
from moejax.vocab import FAMILIES

_INTS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "first_k_dense_replace",
    "decoder_sparse_step",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "index_topk",
    "index_head_dim",
    "index_n_heads",
    "max_position_embeddings",
    "sliding_window",
    "experts_per_token",
    "index_topk_freq",
    "index_skip_topk_offset",
)
_NUMBERS = ("rms_norm_eps", "routed_scaling_factor", "initializer_range", "swiglu_alpha", "swiglu_limit")

# What transformers' config classes assume when a key that changes the math (and no tensor shape)
# is absent; rope_theta, partial_rotary_factor and the rope mapping just below.
FAMILY_DEFAULTS = {
    "deepseek_v3": dict(
        rms_norm_eps=1e-6, routed_scaling_factor=2.5, n_group=8, topk_group=4, norm_topk_prob=True, rope_interleave=True
    ),
    "glm_moe_dsa": dict(rms_norm_eps=1e-5, routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True),
    "glm4_moe": dict(rms_norm_eps=1e-5, routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True),
    "qwen3_moe": dict(rms_norm_eps=1e-6, norm_topk_prob=False, decoder_sparse_step=1),
    "mixtral": dict(rms_norm_eps=1e-5, sliding_window=None),
    "gpt_oss": dict(rms_norm_eps=1e-5, sliding_window=128, swiglu_alpha=1.702, swiglu_limit=7.0),
}
DEFAULT_THETA = {"mixtral": 1e6, "gpt_oss": 150000.0}
DEFAULT_PARTIAL = {"glm4_moe": 0.5}
DEFAULT_ROPE = {
    "gpt_oss": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    }
}


def _check_types(hf: dict) -> None:
    """The fields computed with, checked first: a wrong-typed value is one error naming it."""
    for key in _INTS:
        if hf.get(key) is not None:
            coerce(hf[key], int, key)
    for key in _NUMBERS:
        if hf.get(key) is not None:
            coerce(hf[key], float, key)


def _checked_model(**fields) -> ModelConfig:
    """A ModelConfig from transformers' values, each checked against its field's type; a field
    transformers leaves null (one the family does not use) keeps its default."""
    return replace_checked(ModelConfig(), {k: v for k, v in fields.items() if v is not None}, "")


def _rope_fields(hf: dict, family: str) -> dict:
    """rope_theta, rope_scaling (normalised) and partial_rotary_factor, read from every place a config puts them."""
    given = [hf[k] for k in ("rope_scaling", "rope_parameters") if hf.get(k) is not None]
    if len(given) == 2 and given[0] != given[1]:
        raise ConfigError("config.json gives both rope_scaling and rope_parameters, and they differ; give one")
    params = given[0] if given else DEFAULT_ROPE.get(family)
    where = "rope_scaling" if hf.get("rope_scaling") is not None else "rope_parameters"
    rope, partial = read_rope(
        params,
        hf.get("rope_theta"),
        hf.get("partial_rotary_factor"),
        hf.get("max_position_embeddings") or 0,
        where,
        DEFAULT_THETA.get(family, 10000.0),
        DEFAULT_PARTIAL.get(family, 1.0),
    )
    if partial != 1.0 and family != "glm4_moe":
        raise ConfigError(
            f"partial_rotary_factor {partial} asks for a partial rotary embedding, which {family}'s code has not"
        )
    return dict(rope_theta=rope.theta, rope_scaling=rope.as_dict(), partial_rotary_factor=partial)


def _indexer_types(hf: dict, n: int) -> list:
    """GLM-5's per-layer indexer (full / shared): `indexer_types`, else the pattern or the
    frequency schedule transformers derives it from."""
    if hf.get("indexer_types") is not None:
        return hf["indexer_types"]
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(p, p) for p in pattern]
    freq, offset = max(hf.get("index_topk_freq") or 1, 1), hf.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


def from_hf_config(hf: dict) -> ModelConfig:
    """A `ModelConfig` from a transformers `config.json` dict (the supported families)."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"unsupported architecture {model_type!r} (supported: {', '.join(FAMILIES)})")
    _check_types(hf)
    check_keys(hf)
    hf = FAMILY_DEFAULTS[model_type] | hf
    g = hf.get
    n = g("num_hidden_layers")
    common = dict(
        vocab_size=g("vocab_size"),
        hidden_size=g("hidden_size"),
        num_layers=n,
        num_heads=g("num_attention_heads"),
        num_kv_heads=g("num_key_value_heads") or g("num_attention_heads"),
        **_rope_fields(hf, model_type),
        rms_norm_eps=g("rms_norm_eps"),
        tie_word_embeddings=bool(g("tie_word_embeddings", False)),
        max_position_embeddings=g("max_position_embeddings", 4096),
        initializer_range=g("initializer_range", 0.02),
        num_experts_per_tok=g("num_experts_per_tok"),
    )
    head_dim = g("head_dim") or g("hidden_size") // g("num_attention_heads")
    if model_type == "qwen3_moe":
        step = g("decoder_sparse_step")
        only = set(g("mlp_only_layers") or [])
        dense = tuple(i for i in range(n) if i in only or (i + 1) % step != 0)
        bias = bool(g("attention_bias", False))
        return _checked_model(
            family="qwen3_moe",
            **common,
            head_dim=head_dim,
            intermediate_size=g("intermediate_size"),
            moe_intermediate_size=g("moe_intermediate_size"),
            qk_norm=True,
            attention_bias=bias,
            o_bias=bias,
            num_experts=g("num_experts") or g("num_local_experts"),
            norm_topk_prob=bool(g("norm_topk_prob")),
            dense_layers=dense,
        )
    if model_type == "mixtral":
        window = g("sliding_window") or 0  # Mixtral's window, when given, masks every layer
        return _checked_model(
            family="mixtral",
            **common,
            head_dim=head_dim,
            intermediate_size=g("intermediate_size"),
            moe_intermediate_size=g("intermediate_size"),
            num_experts=g("num_local_experts"),
            norm_topk_prob=True,
            sliding_window=window,
            sliding_layers=tuple(range(n)) if window else (),
        )
    if model_type in ("glm4_moe", "deepseek_v3", "glm_moe_dsa"):
        sigmoid = dict(
            intermediate_size=g("intermediate_size"),
            moe_intermediate_size=g("moe_intermediate_size"),
            num_experts=g("n_routed_experts") or g("num_local_experts"),
            num_shared_experts=g("n_shared_experts") or 0,
            router_scoring="sigmoid",
            router_bias=True,
            norm_topk_prob=bool(g("norm_topk_prob")),
            routed_scaling_factor=float(g("routed_scaling_factor")),
            n_group=g("n_group") or 1,
            topk_group=g("topk_group") or 1,
            dense_layers=tuple(range(g("first_k_dense_replace") or 0)),
        )
        if g("mlp_layer_types"):
            sigmoid["dense_layers"] = tuple(i for i, t in enumerate(g("mlp_layer_types")) if t == "dense")
        if model_type == "glm4_moe":
            return _checked_model(
                family="glm4_moe",
                **common,
                **sigmoid,
                head_dim=head_dim,
                attention_bias=bool(g("attention_bias", False)),
                qk_norm=bool(g("use_qk_norm", False)),
            )
        dsa = {}
        if model_type == "glm_moe_dsa":
            dsa = dict(
                index_topk=g("index_topk"),
                index_head_dim=g("index_head_dim"),
                index_n_heads=g("index_n_heads"),
                dsa_shared_layers=tuple(i for i, t in enumerate(_indexer_types(hf, n)) if t == "shared"),
            )
        return _checked_model(
            family=model_type,
            **common,
            **sigmoid,
            **dsa,
            head_dim=g("qk_rope_head_dim"),
            q_lora_rank=g("q_lora_rank") or 0,
            kv_lora_rank=g("kv_lora_rank"),
            qk_nope_head_dim=g("qk_nope_head_dim"),
            qk_rope_head_dim=g("qk_rope_head_dim"),
            v_head_dim=g("v_head_dim"),
            rope_interleave=bool(g("rope_interleave", True)),  # GLM-5: always
        )
    types = g("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if set(types) - {"sliding_attention", "full_attention"} or len(types) != n:
        raise ConfigError(f"layer_types must name sliding_attention or full_attention for each of the {n} layers")
    if g("experts_per_token") not in (None, g("num_experts_per_tok")):
        raise ConfigError(
            f"experts_per_token {g('experts_per_token')} differs from num_experts_per_tok {g('num_experts_per_tok')}"
        )
    bias = bool(g("attention_bias", True))
    return _checked_model(
        family="gpt_oss",
        **common,
        head_dim=head_dim,
        intermediate_size=g("intermediate_size"),
        moe_intermediate_size=g("intermediate_size"),
        num_experts=g("num_local_experts"),
        router_scoring="topk_softmax",
        router_bias=True,
        norm_topk_prob=False,
        attention_bias=bias,
        o_bias=bias,
        attention_sinks=True,
        sliding_window=g("sliding_window") or 0,  # null: full attention, as transformers' mask
        sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        expert_bias=True,
        expert_act="clamped_swiglu",
        swiglu_alpha=float(g("swiglu_alpha")),
        swiglu_limit=float(g("swiglu_limit")),
    )
