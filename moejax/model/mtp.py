"""The multi-token-prediction (MTP) draft module, DeepSeek-V3 / GLM style.

From the target's hidden state at position i (after its final norm) and the embedding of the
token at i + 1, it predicts the token at i + 2: both normalised, concatenated, projected
(`eh_proj`), one decoder layer (MoE; with its own DSA indexer on GLM-5) over its own KV cache,
its own final norm, then the target's head (the checkpoints' `shared_head.head` is the same).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.config import ModelConfig
from moejax.model import paged
from moejax.model.attention import cache_specs
from moejax.model.layers import rms_norm, rope_cos_sin
from moejax.model.params import ParamSpec, layer_specs
from moejax.model.transformer import ROWS, decoder_layer, layer_params


def mtp_specs(c: ModelConfig) -> dict:
    d = c.hidden_size
    return {
        "enorm": ParamSpec((d,), ("embed",), "ones"),
        "hnorm": ParamSpec((d,), ("embed",), "ones"),
        "eh_proj": ParamSpec((2 * d, d), (None, "embed")),  # [embedding; hidden] -> D
        "layer": layer_specs(c, c.num_layers),
        "norm": ParamSpec((d,), ("embed",), "ones"),
    }


def init_mtp_cache(c: ModelConfig, batch: int, max_len: int, dtype) -> dict:
    """The MTP layer's own cache (the layer index past the last: an indexer of its own)."""
    return {k: jnp.zeros(shape, dtype) for k, (shape, _) in cache_specs(c, batch, max_len, c.num_layers).items()}


def init_mtp_pool(c: ModelConfig, pages: int, page_size: int, dtype) -> dict:
    """The MTP layer's own page pool (`model/paged.py`), indexed by the target's block tables."""
    return {
        k: jnp.zeros(paged.pool_spec(shape, axes, pages, page_size)[0], dtype)
        for k, (shape, axes) in cache_specs(c, 1, 1, c.num_layers).items()
    }


def mtp_forward(
    mtp: dict,
    params: dict,
    cache: dict,
    hidden: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    c: ModelConfig,
    placement,
    pages=None,
) -> tuple[jax.Array, dict]:
    """hidden: [B, T, D] the target's hidden states at positions - 1; tokens, positions: [B, T]
    -> (h: [B, T, D] after the MTP norm, for `lm_head`, cache); pages: the block tables [B, P]
    of a paged cache, or None."""
    e = rms_norm(params["embed"][tokens], mtp["enorm"], c.rms_norm_eps)
    h = rms_norm(hidden, mtp["hnorm"], c.rms_norm_eps)
    x = placement.constrain(jnp.concatenate([e, h], axis=-1) @ mtp["eh_proj"], ROWS)
    experts = placement.gather_experts(mtp["layer"]["moe"]["experts"])
    if pages is not None:  # as a run of one layer's pools [1, pages, ...] (a bitcast)
        cache, pages = {k: a[None] for k, a in cache.items()}, paged.LayerPages(pages, 0)
    x, cache, _, _ = decoder_layer(
        mtp["layer"], experts, x, positions, rope_cos_sin(c, positions), cache, None, c, placement, pages=pages
    )
    if pages is not None:
        cache = {k: a[0] for k, a in cache.items()}
    return rms_norm(x, mtp["norm"], c.rms_norm_eps), cache


def mirrored_draft(params: dict, c: ModelConfig) -> tuple[dict, dict]:
    """(target params with unit-RMS embedding rows, a draft module that repeats the target's
    last layer on the next token's normed embedding and ends in the target's final norm).

    The hidden half of `eh_proj` is zero and the normed embedding equals the raw one, so on a
    one-layer target the draft computes what the target will compute at the next position
    (it misses only position 0 in its cache): most drafts are accepted. For benchmarks and
    tests of the accept path."""
    d = c.hidden_size
    embed = params["embed"]
    embed = embed * jax.lax.rsqrt(jnp.mean(jnp.square(embed.astype(jnp.float32)), -1, keepdims=True)).astype(
        embed.dtype
    )
    mtp = {
        "enorm": jnp.ones((d,), embed.dtype),
        "hnorm": jnp.ones((d,), embed.dtype),
        "eh_proj": jnp.concatenate([jnp.eye(d, dtype=embed.dtype), jnp.zeros((d, d), embed.dtype)]),
        "layer": layer_params(params, c.num_layers - 1, c),
        "norm": params["final_norm"],
    }
    return {**params, "embed": embed}, mtp
