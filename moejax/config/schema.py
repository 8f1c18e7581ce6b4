"""The configuration schema: one dataclass per section of a run, each checking its own values.

One `ModelConfig` describes every supported family; the family name only selects the few
places where the families really differ (attention kind, router scoring, rope layout).
`Config` is the whole run: model + layout (placement) + weights + kernel + engine.
"""

from __future__ import annotations

import dataclasses
import sys

from moejax.config.errors import ConfigError
from moejax.config.rope import Rope, read_rope
from moejax.vocab import (
    ALIASES,
    ATTENTION_KERNELS,
    ATTENTION_MODES,
    DISPATCH_DTYPES,
    EXPERT_ACTIVATIONS,
    EXPERT_FORMATS,
    FAMILIES,
    KERNELS,
    LAYER_LOOPS,
    ROUTER_SCORINGS,
    ROUTING_MODES,
    RUN_DTYPES,
    SPLIT_MODES,
)


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
    rope_scaling: dict | None = None  # a rope mapping as `rope.read_rope` reads it; None: no scaling
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
    def rope(self) -> Rope:
        """The rotary embedding, read from rope_theta, rope_scaling and partial_rotary_factor."""
        return read_rope(
            self.rope_scaling,
            self.rope_theta,
            self.partial_rotary_factor,
            self.max_position_embeddings,
            "model.rope_scaling",
        )[0]

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim); MLA (as DeepSeek defines it) also takes yarn's mscale_all_dim correction."""
        scale = self.qk_head_dim**-0.5
        return scale * self.rope.mla_softmax_factor if self.is_mla else scale

    def validate(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"model.family {self.family!r} is not one of {', '.join(FAMILIES)}")
        read_rope(
            self.rope_scaling,
            self.rope_theta,
            self.partial_rotary_factor,
            self.max_position_embeddings,
            "model.rope_scaling",
        )  # an unreadable rope mapping ends here, in one line
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts {self.num_experts}"
            )
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ConfigError(
                f"n_group {self.n_group} / topk_group {self.topk_group} do not fit {self.num_experts} experts"
            )
        if self.router_scoring not in ROUTER_SCORINGS:
            raise ConfigError(f"router_scoring {self.router_scoring!r} is not one of {', '.join(ROUTER_SCORINGS)}")
        if self.expert_act not in EXPERT_ACTIVATIONS:
            raise ConfigError(f"expert_act {self.expert_act!r} is not one of {', '.join(EXPERT_ACTIVATIONS)}")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers) or (
            self.sliding_layers and self.sliding_window < 1
        ):
            raise ConfigError(
                f"sliding_layers {self.sliding_layers} need a sliding_window >= 1 and layers in "
                f"0..{self.num_layers - 1}"
            )
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ConfigError(f"dense_layers {self.dense_layers} outside 0..{self.num_layers - 1}")
        if self.is_dsa:
            if (
                not 0 < self.qk_rope_head_dim <= self.index_head_dim
                or self.index_n_heads < 1
                or self.index_topk < 1
                or not self.q_lora_rank
            ):
                raise ConfigError(
                    f"the DSA indexer needs q_lora_rank, index_topk, index_n_heads >= 1 and "
                    f"index_head_dim >= qk_rope_head_dim {self.qk_rope_head_dim}"
                )
            if any(not 0 < i < self.num_layers for i in self.dsa_shared_layers):
                raise ConfigError(
                    f"dsa_shared_layers {self.dsa_shared_layers} must lie in 1..{self.num_layers - 1} "
                    "(layer 0 has no selection to share)"
                )


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
    # Expert placement (Row-Meets-Experts; `sharding/slots.py`): spare slots per MoE layer for
    # replicas of hot experts (a multiple of ep), a `moejax record` trace to place the experts by
    # at load (""), and rebalancing from live picks every `eplb_interval` scheduler steps over the
    # last `eplb_window` forward passes.
    redundant_experts: int = 0
    eplb: str = ""
    eplb_online: bool = False
    eplb_window: int = 64
    eplb_interval: int = 32

    def validate(self) -> None:
        if self.redundant_experts < 0:
            raise ConfigError(f"layout.redundant_experts must not be negative, got {self.redundant_experts}")
        if self.eplb_window < 1 or self.eplb_interval < 1:
            raise ConfigError(
                f"layout.eplb_window and layout.eplb_interval must be at least 1, got {self.eplb_window} "
                f"and {self.eplb_interval}"
            )
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
    dtype: str = "auto"  # RUN_DTYPES: activations, weights and KV cache ("auto": moejax.base.platform.run_dtype)
    prefill_chunk: int = 0  # most prompt positions per prefill call; 0 = the platform's default
    max_seq_len: int = 0  # 0 = sized from the prompts and max_new_tokens
    routing: str = "natural"  # ROUTING_MODES; "even:SEED" seeds even's draws, "replay:TRACE" names the trace
    layer_loop: str = "auto"  # LAYER_LOOPS ("auto": moejax.base.platform.Platform.unrolls)
    decode_block: int = 8  # decode steps per dispatched program (1: a program per step; see Engine.decode)
    page_size: int = 0  # Engine: the KV cache as pages of this many positions (0: a contiguous row per request)

    def validate(self) -> None:
        if self.dtype not in RUN_DTYPES:
            raise ConfigError(f"engine.dtype {self.dtype!r} is not one of {', '.join(RUN_DTYPES)}")
        mode, _, arg = self.routing.partition(":")
        arg_ok = {"replay": bool(arg), "even": not arg or arg.isdigit()}.get(mode, not arg)
        if mode not in ROUTING_MODES or not arg_ok:
            raise ConfigError(
                f"engine.routing {self.routing!r} is not one of natural, even[:SEED], round_robin, replay:TRACE"
            )
        if self.prefill_chunk < 0:
            raise ConfigError(
                f"engine.prefill_chunk must be positive (or 0: the platform's default), got {self.prefill_chunk}"
            )
        if self.page_size < 0:
            raise ConfigError(f"engine.page_size must be positive (or 0: a contiguous cache), got {self.page_size}")
        if self.decode_block < 1:
            raise ConfigError(f"engine.decode_block must be at least 1, got {self.decode_block}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ConfigError(f"engine.layer_loop {self.layer_loop!r} is not one of {', '.join(LAYER_LOOPS)}")


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=lambda: _default_model())
    layout: LayoutConfig = LayoutConfig()
    weights: WeightsConfig = WeightsConfig()
    engine: EngineConfig = EngineConfig()
    kernel: str = "auto"
    attention_kernel: str = "auto"  # ATTENTION_KERNELS: how a paged cache's GQA attention reads its pages

    def __post_init__(self):
        for field in ALIASES:
            object.__setattr__(self, field, current_name(field, getattr(self, field)))

    def validate(self) -> Config:
        self.model.validate()
        self.layout.validate()
        self.weights.validate()
        self.engine.validate()
        if self.kernel not in KERNELS:
            raise ConfigError(f"kernel {self.kernel!r} is not one of {', '.join(KERNELS)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ConfigError(
                f"attention_kernel {self.attention_kernel!r} is not one of {', '.join(ATTENTION_KERNELS)}"
            )
        return self


def current_name(field: str, name: str) -> str:
    """Kernel `name` of config `field` ("kernel", "attention_kernel") under its current word: an earlier
    one (`moejax.vocab.ALIASES`) is resolved where it is read (a config file, a flag, a `Config`), with
    a one-line note on stderr."""
    new = ALIASES[field].get(name, name)
    if new != name:
        print(f"note: {field} {name!r} is now called {new!r}", file=sys.stderr)
    return new


def _default_model() -> ModelConfig:
    from moejax.config.presets import PRESETS  # presets are built from this module's classes

    return PRESETS["tiny"]
