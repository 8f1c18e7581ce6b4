"""A model with 4-bit experts (weights.expert_format) against its dequantized twin and its
full-precision self."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import pallas_kernels
from moejax.config import Config, WeightsConfig, preset
from moejax.engine.engine import Engine
from moejax.launch.loading import load_params
from moejax.model.transformer import layer_params
from sharding import make_placement

PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42]]


def engine_for(fmt: str, params=None) -> Engine:
    config = Config(model=preset("tiny"), weights=WeightsConfig(fmt)).validate()
    placement = make_placement(config)
    if params is None:
        return Engine(config, load_params(config, placement, seed=2), placement)
    return Engine(config, params, placement, arranged=True)  # another engine's, already laid out for this placement


@functools.cache
def generation(fmt: str, twin: bool = False):
    engine = engine_for(fmt)
    if twin:  # the same 4-bit values, dequantized, through the full-precision path
        params = jax.tree.map(
            lambda a: pallas_kernels.dequantize(a) if isinstance(a, pallas_kernels.QuantizedArray) else a,
            engine.params,
            is_leaf=lambda a: isinstance(a, pallas_kernels.QuantizedArray),
        )
        engine = engine_for("unquantized", params)
    return engine.generate(PROMPTS, 8, return_logits=True)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_4bit_model_gives_its_dequantized_twins_logits(fmt):
    got, twin = generation(fmt), generation(fmt, twin=True)
    assert got.tokens == twin.tokens
    np.testing.assert_allclose(got.logits, twin.logits, rtol=0, atol=1e-4 * np.abs(twin.logits).max())


def first_step_error(fmt: str) -> float:
    """Mean logit error of the first new token (same prompts, so comparable) against full precision."""
    return float(np.abs(generation(fmt).logits[0] - generation("unquantized").logits[0]).mean())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_4bit_greedy_token_stays_among_the_full_precision_best(fmt):
    """Weights at std 0.2 through two MoE layers: e2m1's 3 bits move logits by tens of
    percent, but not past the model's own best few tokens (the top 2% of the vocabulary)."""
    full = generation("unquantized").logits[0]
    assert first_step_error(fmt) < 0.5 * np.abs(full).mean()
    best = np.argsort(full, axis=-1)[:, -full.shape[-1] // 50 :]
    assert all(t in best[i] for i, t in enumerate(generation(fmt).logits[0].argmax(-1)))


def test_4bit_experts_are_about_a_quarter_of_the_bytes():
    def experts(fmt):  # a MoE layer's
        engine = engine_for(fmt)
        return layer_params(engine.params, 1, preset("tiny"), engine.loops)["moe"]["experts"]

    full, nvfp4 = experts("unquantized"), experts("nvfp4")
    ratio = sum(pallas_kernels.nbytes(a) for a in jax.tree.leaves(full)) / sum(
        pallas_kernels.nbytes(a)
        for a in jax.tree.leaves(nvfp4, is_leaf=lambda a: isinstance(a, pallas_kernels.QuantizedArray))
    )
    assert ratio > 7  # float32 against 4.5 bits per value
