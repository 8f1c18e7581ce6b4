"""Configuration: dataclasses, presets, YAML/JSON loading, transformers `config.json` import.

One `ModelConfig` describes every supported family; the family name only selects the few
places where the families really differ (attention kind, router scoring, rope layout).
`Config` is the whole run: model + layout (placement) + weights + kernel + engine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from moejax.vocab import (ATTENTION_MODES, DISPATCH_DTYPES, EXPERT_ACTIVATIONS, EXPERT_FORMATS, FAMILIES, KERNELS,
                          LAYER_LOOPS, ROUTER_SCORINGS, ROUTING_MODES, RUN_DTYPES, SPLIT_MODES)


class ConfigError(ValueError):
    """A configuration the user wrote that cannot run; the message is one line for the CLI."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str = "qwen3_moe"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128  # dense MLP layers
    moe_intermediate_size: int = 32  # one routed expert
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    # MLA (deepseek_v3): q_lora_rank 0 means a plain q projection.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DSA (glm_moe_dsa): the indexer keeps each query's top `index_topk` key positions; layers
    # in `dsa_shared_layers` reuse the selection of the layer before them.
    index_topk: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    dsa_shared_layers: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # transformers' rope_parameters minus rope_theta (yarn)
    partial_rotary_factor: float = 1.0
    rope_interleave: bool = False
    attention_bias: bool = False
    o_bias: bool = False  # gpt-oss: the output projection has a bias too
    attention_sinks: bool = False  # gpt-oss: one learned logit per head joins each softmax
    sliding_window: int = 0  # layers in `sliding_layers` see only the last `sliding_window` positions
    sliding_layers: tuple[int, ...] = ()
    qk_norm: bool = False
    rms_norm_eps: float = 1e-6
    num_experts: int = 8
    num_experts_per_tok: int = 2
    num_shared_experts: int = 0
    router_scoring: str = "softmax"  # softmax | sigmoid | topk_softmax (softmax over the k best logits)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    router_bias: bool = False  # e_score_correction_bias (sigmoid routers); added to the logits (topk_softmax)
    expert_bias: bool = False  # gpt-oss: biases on the experts' gate, up and down projections
    expert_act: str = "silu"  # silu: silu(gate) * up | clamped_swiglu (gpt-oss, swiglu_alpha and swiglu_limit)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    n_group: int = 1
    topk_group: int = 1
    dense_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02

    @property
    def is_mla(self) -> bool:
        return self.family in ("deepseek_v3", "glm_moe_dsa")

    @property
    def is_dsa(self) -> bool:
        return self.family == "glm_moe_dsa"

    def has_indexer(self, layer: int) -> bool:
        """Whether `layer` runs its own DSA indexer (the MTP layer, past the last, always does)."""
        return self.is_dsa and layer not in self.dsa_shared_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    @property
    def rotary_dim(self) -> int:
        if self.is_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling or {}
        if rs.get("rope_type", "default") != "default" and rs.get("mscale_all_dim"):
            m = yarn_mscale(rs["factor"], rs["mscale_all_dim"])
            scale *= m * m
        return scale

    def validate(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"model.family {self.family!r} is not one of {', '.join(FAMILIES)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts {self.num_experts}")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ConfigError(f"n_group {self.n_group} / topk_group {self.topk_group} do not fit {self.num_experts} experts")
        if self.router_scoring not in ROUTER_SCORINGS:
            raise ConfigError(f"router_scoring {self.router_scoring!r} is not one of {', '.join(ROUTER_SCORINGS)}")
        if self.expert_act not in EXPERT_ACTIVATIONS:
            raise ConfigError(f"expert_act {self.expert_act!r} is not one of {', '.join(EXPERT_ACTIVATIONS)}")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers) or (self.sliding_layers and self.sliding_window < 1):
            raise ConfigError(f"sliding_layers {self.sliding_layers} need a sliding_window >= 1 and layers in "
                              f"0..{self.num_layers - 1}")
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ConfigError(f"dense_layers {self.dense_layers} outside 0..{self.num_layers - 1}")
        if self.is_dsa:
            if (not 0 < self.qk_rope_head_dim <= self.index_head_dim or self.index_n_heads < 1 or self.index_topk < 1
                    or not self.q_lora_rank):
                raise ConfigError(f"the DSA indexer needs q_lora_rank, index_topk, index_n_heads >= 1 and "
                                  f"index_head_dim >= qk_rope_head_dim {self.qk_rope_head_dim}")
            if any(not 0 < i < self.num_layers for i in self.dsa_shared_layers):
                raise ConfigError(f"dsa_shared_layers {self.dsa_shared_layers} must lie in 1..{self.num_layers - 1} "
                                  "(layer 0 has no selection to share)")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class LayoutConfig:
    # A name from the placement registry (`sharding.registry`, which checks it); "" = its default.
    # Config files may still say `experts:` (the key's earlier name).
    placement: str = ""
    # 0: "auto", this host's choice, made when the engine is built (`commands.host_layout`). The
    # runtime verbs ask for it when no flag or file chose a layout.
    devices: int = 1
    ep: int = 0  # placements with an (ep x tp) mesh of their own choosing; 0 = the placement's choice
    tp: int = 0
    attention: str = "dp"  # ATTENTION_MODES
    dense: str = "tp"  # SPLIT_MODES
    shared_expert: str = "tp"  # SPLIT_MODES
    head: str = "replicated"  # SPLIT_MODES: the vocab axis (embedding and LM head) sliced over every device, or copied
    dispatch_dtype: str = "bf16"  # DISPATCH_DTYPES: rows as they travel, for placements that send rows
    prefetch_depth: int = 1  # placements that gather weights ahead of use: layers ahead
    # Placements that move rows: each device's rows of a MoE layer as two micro-batches, one's
    # exchange issued while the other computes (`sharding/overlap.py`).
    two_batch_overlap: bool = False

    def validate(self) -> None:
        if self.devices < 0:
            raise ConfigError(f"devices must be at least 1 (or 0: this host's choice), got {self.devices}")
        if self.ep < 0 or self.tp < 0:
            raise ConfigError(f"layout.ep and layout.tp must not be negative, got {self.ep} and {self.tp}")
        for name, value, allowed in (
            ("attention", self.attention, ATTENTION_MODES),
            ("dense", self.dense, SPLIT_MODES),
            ("shared_expert", self.shared_expert, SPLIT_MODES),
            ("head", self.head, SPLIT_MODES),
            ("dispatch_dtype", self.dispatch_dtype, DISPATCH_DTYPES),
        ):
            if value not in allowed:
                raise ConfigError(f"layout.{name} {value!r} is not one of {', '.join(allowed)}")
        if self.prefetch_depth < 0:
            raise ConfigError(f"layout.prefetch_depth must be 0 (gather at use) or more, got {self.prefetch_depth}")


# The expert format's earlier name for "unquantized", still read from config files and checkpoints.
OLD_EXPERT_FORMAT_NAMES = {"bf16": "unquantized"}


@dataclasses.dataclass(frozen=True)
class WeightsConfig:
    expert_format: str = "unquantized"  # EXPERT_FORMATS: the run dtype, or a 4-bit format

    def __post_init__(self):
        object.__setattr__(self, "expert_format", OLD_EXPERT_FORMAT_NAMES.get(self.expert_format, self.expert_format))

    def validate(self) -> None:
        if self.expert_format not in EXPERT_FORMATS:
            raise ConfigError(f"weights.expert_format {self.expert_format!r} is not one of {', '.join(EXPERT_FORMATS)}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    dtype: str = "auto"  # RUN_DTYPES: activations, weights and KV cache ("auto": moejax.platform.run_dtype)
    prefill_chunk: int = 0  # most prompt positions per prefill call; 0 = the platform's default
    max_seq_len: int = 0  # 0 = sized from the prompts and max_new_tokens
    routing: str = "natural"  # ROUTING_MODES; "even:SEED" seeds even's draws, "replay:TRACE" names the trace
    layer_loop: str = "auto"  # LAYER_LOOPS ("auto": moejax.platform.unrolls)
    decode_block: int = 8  # decode steps per dispatched program (1: a program per step; see Engine.decode)

    def validate(self) -> None:
        if self.dtype not in RUN_DTYPES:
            raise ConfigError(f"engine.dtype {self.dtype!r} is not one of {', '.join(RUN_DTYPES)}")
        mode, _, arg = self.routing.partition(":")
        arg_ok = {"replay": bool(arg), "even": not arg or arg.isdigit()}.get(mode, not arg)
        if mode not in ROUTING_MODES or not arg_ok:
            raise ConfigError(f"engine.routing {self.routing!r} is not one of natural, even[:SEED], round_robin, "
                              "replay:TRACE")
        if self.prefill_chunk < 0:
            raise ConfigError(f"engine.prefill_chunk must be positive (or 0: the platform's default), got {self.prefill_chunk}")
        if self.decode_block < 1:
            raise ConfigError(f"engine.decode_block must be at least 1, got {self.decode_block}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ConfigError(f"engine.layer_loop {self.layer_loop!r} is not one of {', '.join(LAYER_LOOPS)}")


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=lambda: PRESETS["tiny"])
    layout: LayoutConfig = LayoutConfig()
    weights: WeightsConfig = WeightsConfig()
    engine: EngineConfig = EngineConfig()
    kernel: str = "auto"

    def validate(self) -> "Config":
        self.model.validate()
        self.layout.validate()
        self.weights.validate()
        self.engine.validate()
        if self.kernel not in KERNELS:
            raise ConfigError(f"kernel {self.kernel!r} is not one of {', '.join(KERNELS)}")
        return self


# ----------------------------------------------------------------------------- presets

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
    "tiny-deepseek-v3": _tiny_mla(),
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
    # Mid-size model of the benchmark (issue 2): Qwen3-MoE geometry scaled down.
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


# ----------------------------------------------------------------------------- transformers import

_HF_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts",
            "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
            "first_k_dense_replace", "decoder_sparse_step", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "index_topk", "index_head_dim", "index_n_heads",
            "max_position_embeddings")
_HF_NUMBERS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor", "initializer_range", "partial_rotary_factor")


def _check_hf_types(hf: dict) -> None:
    """The fields `from_hf_config` computes with, checked before it does: a wrong-typed value
    is one error naming the field, not a TypeError deep in the arithmetic."""
    for key in _HF_INTS:
        if hf.get(key) is not None:
            _coerce(hf[key], int, key)
    for key in _HF_NUMBERS:
        if hf.get(key) is not None:
            _coerce(hf[key], float, key)


def _checked_model(**fields) -> ModelConfig:
    """A ModelConfig from transformers' values, each checked against its field's type; a field
    transformers leaves null (one the family does not use) keeps its default."""
    return replace_checked(ModelConfig(), {k: v for k, v in fields.items() if v is not None}, "")


def from_hf_config(hf: dict) -> ModelConfig:
    """A `ModelConfig` from a transformers `config.json` dict (the supported families)."""
    model_type = hf.get("model_type")
    _check_hf_types(hf)
    g = hf.get
    rope = dict(g("rope_parameters") or g("rope_scaling") or {})
    rope_theta = float(rope.pop("rope_theta", g("rope_theta", 10000.0)))
    partial = float(rope.pop("partial_rotary_factor", g("partial_rotary_factor", 1.0)))
    rope_scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
    n = g("num_hidden_layers")
    common = dict(
        vocab_size=g("vocab_size"), hidden_size=g("hidden_size"), num_layers=n,
        num_heads=g("num_attention_heads"), num_kv_heads=g("num_key_value_heads") or g("num_attention_heads"),
        rope_theta=rope_theta, rope_scaling=rope_scaling, partial_rotary_factor=partial,
        rms_norm_eps=g("rms_norm_eps", 1e-6), tie_word_embeddings=bool(g("tie_word_embeddings", False)),
        max_position_embeddings=g("max_position_embeddings", 4096), initializer_range=g("initializer_range", 0.02),
        num_experts_per_tok=g("num_experts_per_tok"),
    )
    head_dim = g("head_dim") or g("hidden_size") // g("num_attention_heads")
    if g("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {g('hidden_act')!r} is not supported (only silu)")
    if model_type == "qwen3_moe":
        step = g("decoder_sparse_step", 1)
        only = set(g("mlp_only_layers") or [])
        dense = tuple(i for i in range(n) if i in only or (i + 1) % step != 0)
        return _checked_model(
            family="qwen3_moe", **common, head_dim=head_dim, intermediate_size=g("intermediate_size"),
            moe_intermediate_size=g("moe_intermediate_size"), qk_norm=True,
            attention_bias=bool(g("attention_bias", False)),
            num_experts=g("num_experts") or g("num_local_experts"), norm_topk_prob=bool(g("norm_topk_prob")),
            dense_layers=dense,
        )
    if model_type == "mixtral":
        return _checked_model(
            family="mixtral", **common, head_dim=head_dim, intermediate_size=g("intermediate_size"),
            moe_intermediate_size=g("intermediate_size"), num_experts=g("num_local_experts"),
            norm_topk_prob=True,
        )
    if model_type in ("glm4_moe", "deepseek_v3", "glm_moe_dsa"):
        sigmoid = dict(
            intermediate_size=g("intermediate_size"), moe_intermediate_size=g("moe_intermediate_size"),
            num_experts=g("n_routed_experts") or g("num_local_experts"), num_shared_experts=g("n_shared_experts") or 0,
            router_scoring="sigmoid", router_bias=True, norm_topk_prob=bool(g("norm_topk_prob", True)),
            routed_scaling_factor=float(g("routed_scaling_factor", 1.0)), n_group=g("n_group") or 1,
            topk_group=g("topk_group") or 1, dense_layers=tuple(range(g("first_k_dense_replace") or 0)),
        )
        if g("mlp_layer_types"):
            sigmoid["dense_layers"] = tuple(i for i, t in enumerate(g("mlp_layer_types")) if t == "dense")
        if model_type == "glm4_moe":
            return _checked_model(
                family="glm4_moe", **common, **sigmoid, head_dim=head_dim,
                attention_bias=bool(g("attention_bias", False)), qk_norm=bool(g("use_qk_norm", False)),
            )
        dsa = {}
        if model_type == "glm_moe_dsa":
            dsa = dict(index_topk=g("index_topk"), index_head_dim=g("index_head_dim"), index_n_heads=g("index_n_heads"),
                       dsa_shared_layers=tuple(i for i, t in enumerate(g("indexer_types") or []) if t == "shared"))
        return _checked_model(
            family=model_type, **common, **sigmoid, **dsa, head_dim=g("qk_rope_head_dim"),
            q_lora_rank=g("q_lora_rank") or 0, kv_lora_rank=g("kv_lora_rank"),
            qk_nope_head_dim=g("qk_nope_head_dim"), qk_rope_head_dim=g("qk_rope_head_dim"),
            v_head_dim=g("v_head_dim"), rope_interleave=bool(g("rope_interleave", True)),
            attention_bias=bool(g("attention_bias", False)),
        )
    if model_type == "gpt_oss":
        types = g("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        bias = bool(g("attention_bias", True))
        return _checked_model(
            family="gpt_oss", **common, head_dim=head_dim, intermediate_size=g("intermediate_size"),
            moe_intermediate_size=g("intermediate_size"), num_experts=g("num_local_experts"),
            router_scoring="topk_softmax", router_bias=True, norm_topk_prob=False, attention_bias=bias, o_bias=bias,
            attention_sinks=True, sliding_window=g("sliding_window") or 0,
            sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
            expert_bias=True, expert_act="clamped_swiglu", swiglu_alpha=float(g("swiglu_alpha", 1.702)),
            swiglu_limit=float(g("swiglu_limit", 7.0)),
        )
    raise ConfigError(f"unsupported architecture {model_type!r} (supported: {', '.join(FAMILIES)})")


# ----------------------------------------------------------------------------- files and overrides

def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Checks `value` against a dataclass field type; one clear error naming the key otherwise."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{where} must be a list of integers, got {value!r}")
        return tuple(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return value
    return value


def replace_checked(obj: Any, updates: dict, prefix: str) -> Any:
    """`dataclasses.replace` that rejects unknown keys and wrongly typed values by name."""
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    clean = {}
    for key, value in updates.items():
        where = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key {where!r}")
        clean[key] = _coerce(value, hints[key], where)
    return dataclasses.replace(obj, **clean)


def from_dict(data: dict, base: Config | None = None, preset_name: str | None = None) -> Config:
    """Builds a `Config` from the DESIGN.md shape: {preset, model, layout, weights, engine, kernel}.

    The model starts from `preset_name` (the CLI's --preset, which wins), else the file's own
    `preset`, else `base`'s; the file's `model:` fields then apply on top of it."""
    if not isinstance(data, dict):
        raise ConfigError("a config file must hold a mapping at the top level")
    cfg = base or Config()
    data = dict(data)
    name = data.pop("preset", None)
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"'preset' must be a string, got {name!r}")
    if preset_name or name:
        cfg = dataclasses.replace(cfg, model=preset(preset_name or name))
    sections = {"model": ModelConfig, "layout": LayoutConfig, "weights": WeightsConfig, "engine": EngineConfig}
    for key, value in data.items():
        if key in sections:
            if not isinstance(value, dict):
                raise ConfigError(f"'{key}' must be a mapping, got {value!r}")
            if key == "layout" and "experts" in value:  # the placement key's earlier name
                value = {("placement" if k == "experts" else k): v for k, v in value.items()}
            cfg = dataclasses.replace(cfg, **{key: replace_checked(getattr(cfg, key), value, f"{key}.")})
        elif key == "kernel":
            cfg = dataclasses.replace(cfg, kernel=_coerce(value, str, "kernel"))
        else:
            raise ConfigError(f"unknown config key {key!r}")
    return cfg


def load_file(path: str | Path, base: Config | None = None, preset_name: str | None = None) -> Config:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"config file {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                          f"{str(e).splitlines()[0]}") from None
    return from_dict(data or {}, base, preset_name)


def to_dict(cfg: Config) -> dict:
    d = dataclasses.asdict(cfg)
    d["model"]["dense_layers"] = list(cfg.model.dense_layers)
    return d
