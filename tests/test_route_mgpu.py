"""The Hopper router kernel (`route_mgpu`) without a GPU: jax's Mosaic GPU interpreter against float64
numpy for each scoring, at widths no tile of the kernel's is (D 192: three K steps; E 40 experts,
k 3 picks in a register tile of 8 columns; 3 rows of a 64-row tile, and 70: two row tiles), one and
two K slices, the experts whole and in chunks (the second launch summing the partial logits); a
width it does not take refused in one line; and the lowering and XLA:GPU compile for a compile-only
H100 of Qwen3-30B-A3B's router at batch 1."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_only import lower, on_h100

from moejax.base import targets
from moejax.base.platform import tile_device
from moejax.compiled import hlo
from pallas_kernels import catalog, registry
from pallas_kernels.route_mgpu import Tiles, route_mgpu

EPS, E, K = 1e-6, 40, 3


def f64(a):
    return np.asarray(a, np.float64)


def reference(x, norm, router, bias, scoring, norm_topk_prob, scale):
    """float64 numpy: the normed rows rounded to bf16 as the model rounds them, then `router.route`."""
    xf = f64(x)
    normed = xf / np.sqrt(np.mean(xf * xf, axis=1, keepdims=True) + EPS)
    h = f64(norm) * f64(jnp.asarray(normed, jnp.float32).astype(jnp.bfloat16))
    logits = h @ f64(router)
    b = 0.0 if bias is None else f64(bias)
    if scoring == "softmax":
        scores = choice = np.exp(logits - logits.max(1, keepdims=True))
        scores = choice = scores / scores.sum(1, keepdims=True)
    elif scoring == "topk_softmax":
        scores = choice = logits + b
    else:
        scores = 1 / (1 + np.exp(-logits))
        choice = scores + b
    ids = np.argsort(-choice, axis=1, kind="stable")[:, :K]
    weights = np.take_along_axis(scores, ids, axis=1)
    if scoring == "topk_softmax":
        weights = np.exp(weights - weights.max(1, keepdims=True))
        weights = weights / weights.sum(1, keepdims=True)
    if norm_topk_prob:
        weights = weights / weights.sum(1, keepdims=True)
    return h, ids, weights * scale


@pytest.mark.parametrize(
    "scoring, m, d, splits, e, norm_topk_prob",
    [
        ("softmax", 3, 192, 1, None, False),
        ("sigmoid", 70, 192, 1, None, True),
        ("topk_softmax", 3, 256, 2, None, False),
        ("sigmoid", 70, 256, 2, 8, True),  # experts in 5 chunks of 8: each slice's chunks, then the sum
    ],
)
def test_the_interpreted_router_is_float64s(scoring, m, d, splits, e, norm_topk_prob):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
    norm = jnp.asarray(rng.standard_normal(d) * 0.2 + 1, jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((d, E)) * d**-0.5, jnp.float32)
    bias = None if scoring == "softmax" else jnp.asarray(rng.standard_normal(E) * 0.3, jnp.float32)
    h, ids, weights, slot = route_mgpu(
        x, norm, router, k=K, eps=EPS, scoring=scoring, bias=bias, norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=2.5, tiles=Tiles(k=64, splits=splits, steps=2, e=e), interpret=True,
    )  # fmt: skip
    want_h, want_ids, want_weights = reference(x, norm, router, bias, scoring, norm_topk_prob, 2.5)
    assert slot is None and ids.shape == weights.shape == (m, K) and ids.dtype == jnp.int32
    # h: bf16, one rounding of the norm's product off float64's
    np.testing.assert_allclose(f64(h), want_h, rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(f64(weights), want_weights, rtol=1e-5, atol=1e-6)  # float32 products


def test_a_width_it_does_not_take_is_refused():
    rng = np.random.default_rng(1)
    x, norm = jnp.ones((2, 200), jnp.bfloat16), jnp.ones((200,), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((200, E)), jnp.float32)
    with pytest.raises(ValueError, match=r"route_mgpu: D must be a multiple of 64 .*got D=200"):
        route_mgpu(x, norm, router, k=K, eps=EPS, scoring="softmax", tiles=Tiles(64, 1, 2), interpret=True)
    record = catalog.kernel(catalog.DECODE, "interpret_mosaic_gpu_router")
    assert "E must be a multiple of 8" in record.why_not("cpu", shapes=[(256, 44, False)])
    assert record.why_not("cpu", shapes=[(256, E, False)]) is None


def test_qwen3s_router_compiles_for_an_h100_in_two_launches_at_batch_1():
    """D 2048, E 128, k 8: its experts in 8 chunks of 16 and D in 32 slices of 64 (the table's rule:
    towards the SMs, 16 KB of partial logits a row at most), then the combine launch."""
    device = targets.devices("h100", 1)[0]
    d, e = 2048, 128

    def run(x, norm, router):
        return registry.route(
            x, norm, router, backend="mosaic_gpu_router", k=8, eps=EPS, scoring="softmax",
            norm_topk_prob=True, device=tile_device(device),
        )[:3]  # fmt: skip

    args = (on_h100((1, d), jnp.bfloat16), on_h100((d,), jnp.bfloat16), on_h100((d, e), jnp.float32))
    text = lower(jax.jit(run), *args).compile().as_text()
    launches = hlo.by_kind(hlo.launches(text))  # the whole call: no XLA op around the kernel's
    assert launches == {"custom-call mosaic_gpu_v2": 2}, launches
    # Each launch's grid, read off the program (the named scope around its call): the chunks of each
    # slice over D, then the combine's one row tile.
    assert sorted(r.instr.programs for r in hlo.pallas_calls(text)) == [1, 8 * 32]
