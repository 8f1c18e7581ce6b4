"""Parameter specs with logical axis names, and their initialisation.

Every parameter is declared once, as a `ParamSpec` (shape + logical axes). The same spec tree
gives random initialisation, the shardings of each placement (`sharding/rules.py` maps the
logical names to mesh axes) and the target shapes of checkpoint loading.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, one per dimension
    init: str = "normal"  # normal | ones | zeros
    float32: bool = False  # kept in float32 whatever the run dtype (router, as transformers does)
    gated: bool = False  # gate and up interleaved along the last axis (`pallas_kernels.epilogue.gate_up_columns`)

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def is_expert_stack(spec: ParamSpec) -> bool:
    """Routed experts [E, ...] (in a run: [layers, E, ...]): the parameters placements split by
    expert and that `weights.expert_format` may store in 4 bits."""
    return "experts" in spec.axes[:2]


def is_expert_matrix(spec: ParamSpec) -> bool:
    """An expert stack of matrices [..., E, K, N] (not a bias [..., E, N]): what 4-bit formats quantize."""
    return spec.axes[-3:-2] == ("experts",)


def expert_axis(spec: ParamSpec) -> int:
    """Where the experts axis of an expert stack lies (1 in a run's stacked tree)."""
    return spec.axes.index("experts")


def _mlp_specs(d: int, f: int, axis: str) -> dict:
    return {
        "gate_up": ParamSpec((d, 2 * f), ("embed", axis), gated=True),
        "down": ParamSpec((f, d), (axis, "embed")),
    }


def _indexer_specs(c: ModelConfig) -> dict:
    """DSA indexer: its own query (from MLA's q latent) and single key head, per-head weights."""
    d, hi, di = c.hidden_size, c.index_n_heads, c.index_head_dim
    return {
        "wq": ParamSpec((c.q_lora_rank, hi, di), (None, None, None)),
        "wk": ParamSpec((d, di), ("embed", None)),
        "k_norm": ParamSpec((di,), (None,), "ones"),  # LayerNorm weight and bias
        "k_norm_bias": ParamSpec((di,), (None,), "zeros"),
        "head_weights": ParamSpec((d, hi), ("embed", None), float32=True),  # float32, as transformers keeps it
    }


def _attention_specs(c: ModelConfig, indexer: bool) -> dict:
    d, h = c.hidden_size, c.num_heads
    if c.is_mla:
        s = {"indexer": _indexer_specs(c)} if indexer else {}
        if c.q_lora_rank:
            s["q_a"] = ParamSpec((d, c.q_lora_rank), ("embed", None))
            s["q_a_norm"] = ParamSpec((c.q_lora_rank,), (None,), "ones")
            s["q_b"] = ParamSpec((c.q_lora_rank, h, c.qk_head_dim), (None, "heads", None))
        else:
            s["q"] = ParamSpec((d, h, c.qk_head_dim), ("embed", "heads", None))
        s["kv_a"] = ParamSpec((d, c.kv_lora_rank + c.qk_rope_head_dim), ("embed", None))
        s["kv_a_norm"] = ParamSpec((c.kv_lora_rank,), (None,), "ones")
        # kv_b split in its key and value halves: attention runs in the latent space (absorbed).
        s["w_uk"] = ParamSpec((c.kv_lora_rank, h, c.qk_nope_head_dim), (None, "heads", None))
        s["w_uv"] = ParamSpec((c.kv_lora_rank, h, c.v_head_dim), (None, "heads", None))
        s["o"] = ParamSpec((h, c.v_head_dim, d), ("heads", None, "embed"))
        return s
    kv, dh = c.num_kv_heads, c.head_dim
    s = {
        "q": ParamSpec((d, h, dh), ("embed", "heads", "head_dim")),
        "k": ParamSpec((d, kv, dh), ("embed", "kv_heads", "head_dim")),
        "v": ParamSpec((d, kv, dh), ("embed", "kv_heads", "head_dim")),
        "o": ParamSpec((h, dh, d), ("heads", "head_dim", "embed")),
    }
    if c.attention_bias:
        s["q_bias"] = ParamSpec((h, dh), ("heads", "head_dim"), "zeros")
        s["k_bias"] = ParamSpec((kv, dh), ("kv_heads", "head_dim"), "zeros")
        s["v_bias"] = ParamSpec((kv, dh), ("kv_heads", "head_dim"), "zeros")
    if c.o_bias:
        s["o_bias"] = ParamSpec((d,), ("embed",), "zeros")
    if c.attention_sinks:
        s["sinks"] = ParamSpec((h,), ("heads",))
    if c.qk_norm:
        s["q_norm"] = ParamSpec((dh,), ("head_dim",), "ones")
        s["k_norm"] = ParamSpec((dh,), ("head_dim",), "ones")
    return s


def _moe_specs(c: ModelConfig) -> dict:
    d, e, f = c.hidden_size, c.num_experts, c.moe_intermediate_size
    s = {
        "router": ParamSpec((d, e), ("embed", None), float32=True),
        # gate and up as one matrix, columns interleaved: one grouped GEMM for both, and any
        # contiguous slice of the 2F columns over tp holds matching gate and up columns.
        "experts": {
            "gate_up": ParamSpec((e, d, 2 * f), ("experts", "embed", "expert_mlp"), gated=True),
            "down": ParamSpec((e, f, d), ("experts", "expert_mlp", "embed")),
        },
    }
    if c.expert_bias:
        s["experts"] |= {
            "gate_up_bias": ParamSpec((e, 2 * f), ("experts", "expert_mlp"), "zeros", gated=True),
            "down_bias": ParamSpec((e, d), ("experts", "embed"), "zeros"),
        }
    if c.router_bias:
        # Random, not zero: at zero, sigmoid routers tie and greedy tokens become a coin toss.
        s["router_bias"] = ParamSpec((e,), (None,), "normal", float32=True)
    if c.num_shared_experts:
        s["shared"] = _mlp_specs(d, f * c.num_shared_experts, "shared_mlp")
    return s


def layer_specs(c: ModelConfig, layer: int) -> dict:
    """One decoder layer; `layer` == num_layers is the MTP module's layer (MoE, own indexer)."""
    d = c.hidden_size
    specs = {
        "attn_norm": ParamSpec((d,), ("embed",), "ones"),
        "attn": _attention_specs(c, c.has_indexer(layer)),
        "mlp_norm": ParamSpec((d,), ("embed",), "ones"),
    }
    if layer in c.dense_layers:
        specs["mlp"] = _mlp_specs(d, c.intermediate_size, "mlp")
    else:
        specs["moe"] = _moe_specs(c)
    return specs


@dataclasses.dataclass(frozen=True)
class Run:
    """Consecutive decoder layers with the same parameter tree: one `lax.scan` runs them, over
    their parameters stacked on a leading "layers" axis."""

    first: int  # its first layer
    count: int

    @property
    def layers(self) -> range:
        return range(self.first, self.first + self.count)

    def is_moe(self, c: ModelConfig) -> bool:
        return self.first not in c.dense_layers


def layer_runs(c: ModelConfig) -> tuple[Run, ...]:
    """The decoder's layers as runs of identical layers: a dense prefix, then the MoE layers
    (a DSA layer that shares the previous layer's selection, having no indexer, ends a run)."""
    kinds = [(i in c.dense_layers, c.has_indexer(i)) for i in range(c.num_layers)]
    runs, first = [], 0
    for i in range(1, c.num_layers + 1):
        if i == c.num_layers or kinds[i] != kinds[first]:
            runs.append(Run(first, i - first))
            first = i
    return tuple(runs)


def stacked(specs, count: int):
    """A layer's spec tree with a leading never-sharded "layers" axis of `count`."""
    return jax.tree.map(
        lambda s: dataclasses.replace(s, shape=(count, *s.shape), axes=("layers", *s.axes)), specs, is_leaf=_is_spec
    )


def param_specs(c: ModelConfig) -> dict:
    """The model's parameters; "layers" holds one stacked tree per run (`layer_runs`)."""
    d = c.hidden_size
    specs = {
        "embed": ParamSpec((c.vocab_size, d), ("vocab", "embed")),
        "layers": [stacked(layer_specs(c, run.first), run.count) for run in layer_runs(c)],
        "final_norm": ParamSpec((d,), ("embed",), "ones"),
    }
    if not c.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((d, c.vocab_size), ("embed", "vocab"))
    return specs


def logical_axes(c: ModelConfig) -> dict:
    return jax.tree.map(lambda s: s.axes, param_specs(c), is_leaf=_is_spec)


def param_dtype(spec: ParamSpec, dtype) -> jnp.dtype:
    return jnp.float32 if spec.float32 else jnp.dtype(dtype)


def abstract_params(c: ModelConfig, dtype=jnp.float32) -> dict:
    """`jax.ShapeDtypeStruct`s of every parameter: shapes without memory."""
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, param_dtype(s, dtype)), param_specs(c), is_leaf=_is_spec
    )


def init_param(spec: ParamSpec, key: jax.Array, c: ModelConfig, dtype=jnp.float32, layer: int | None = None):
    """One parameter as transformers initialises it: normal(0, initializer_range), norms at 1.
    A run's stacked parameter is drawn layer by layer, each layer from its own key, so that
    `layer` alone (a loader placing one layer at a time) is the same as that layer of the whole."""
    dt = param_dtype(spec, dtype)
    if spec.axes[:1] == ("layers",) and layer is None:
        return jnp.stack([init_param(spec, key, c, dtype, i) for i in range(spec.shape[0])])
    shape = spec.shape if layer is None else spec.shape[1:]
    if spec.init in ("ones", "zeros"):  # from the host: no program to compile per shape
        return jnp.asarray(np.full(shape, 1 if spec.init == "ones" else 0, dt))
    k = key if layer is None else jax.random.fold_in(key, layer)
    return _normal(k, shape=shape, dtype=dt, scale=c.initializer_range)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "scale"))
def _normal(key: jax.Array, *, shape: tuple[int, ...], dtype, scale: float) -> jax.Array:
    """scale * N(0, 1) in dtype, drawn in f32: one program per shape, where the eager draw, scale
    and cast are three (a preset's start-up compiles, or fetches from the cache, each of them)."""
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def param_keys(specs: dict, key: jax.Array) -> dict:
    """One random key per parameter of `specs`."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    return jax.tree.unflatten(treedef, list(jax.random.split(key, len(leaves))))


def init_params(c: ModelConfig, key: jax.Array, dtype=jnp.float32, specs: dict | None = None) -> dict:
    """Random parameters (`init_param`). `specs`: another spec tree to initialise (default: the model's)."""
    specs = param_specs(c) if specs is None else specs
    return jax.tree.map(lambda s, k: init_param(s, k, c, dtype), specs, param_keys(specs, key), is_leaf=_is_spec)
