"""fused_linear and topk_route: the Triton kernels (interpreted) against float64 numpy and their XLA
twins; the twins against the model's own functions; both kernels compiled for an H100."""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_only import lower, on_h100

from moejax.compiled import hlo
from moejax.config import preset
from moejax.model.layers import apply_rope, interleave_gate_up, rms_norm, silu_glu
from moejax.model.router import route
from pallas_kernels import routing, tiles
from pallas_kernels.epilogue import gate_up_columns
from pallas_kernels.linear import Tiles, fused_linear
from pallas_kernels.linear_xla import fused_linear_xla
from pallas_kernels.routing import topk_route
from pallas_kernels.topk import topk_route_xla

ROUTE_TILES = routing.Tiles(**tiles.lookup("topk_route"))


def tiles_with(**chosen) -> Tiles:
    """The table's default tiles (`tiles.lookup`), but the test's `chosen` ones."""
    return Tiles(**{**tiles.lookup("fused_linear"), **chosen})


EPS = 1e-6
TRITON = "triton"  # the Pallas compiler of the kernels' calls (`hlo.PALLAS`)


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def _array(rng, shape, dtype, scale=1.0, offset=0.0):
    return jnp.asarray(offset + scale * rng.standard_normal(shape), dtype)


def _rope(rng, m: int, half: int):
    """cos, sin [M, R/2] f32 of random positions (the model's frequencies' form)."""
    angles = rng.integers(0, 4096, (m, 1)) / 10000.0 ** (np.arange(half) / half)
    return jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


# name: (dtype, M, K, the call's layout). Widths none of the blocks divide (K 200, N 72, heads of
# 24 with R 16), several row, column and K tiles (`tiles`), every option in some case.
LINEAR_CASES = {
    "attention bf16 M1": (jnp.bfloat16, 1, 200, "attention"),
    "attention f32 M64": (jnp.float32, 64, 200, "attention"),
    "full rotary f32 M5": (jnp.float32, 5, 37, "full rotary"),
    "gate_up act bf16 M5": (jnp.bfloat16, 5, 200, "gate_up"),
    "residual bf16 M64": (jnp.bfloat16, 64, 72, "residual"),
    "router f32 weights bf16 M5": (jnp.bfloat16, 5, 200, "router"),
    "attention split-K bf16 M1": (jnp.bfloat16, 1, 200, "attention"),
    "gate_up split-K bf16 M5": (jnp.bfloat16, 5, 200, "gate_up"),
    "residual split-K bf16 M3": (jnp.bfloat16, 3, 64, "residual"),
    "router split-K f32 weights bf16 M5": (jnp.bfloat16, 5, 200, "router"),
    "latent bf16 M5": (jnp.bfloat16, 5, 200, "latent"),
    "latent split-K bf16 M1": (jnp.bfloat16, 1, 200, "latent"),
    "latent queries bf16 M3": (jnp.bfloat16, 3, 40, "latent queries"),
    "latent queries f32 M64": (jnp.float32, 64, 40, "latent queries"),
    "latent queries split-K bf16 M1": (jnp.bfloat16, 1, 64, "latent queries"),
}
# The cases whose kernel splits K (f32 partials, the epilogue on their sum): their K steps in slices.
SPLITS = {
    "attention split-K bf16 M1": 2,
    "gate_up split-K bf16 M5": 4,
    "residual split-K bf16 M3": 4,
    "router split-K f32 weights bf16 M5": 4,
    "latent split-K bf16 M1": 2,
    "latent queries split-K bf16 M1": 2,
}


@functools.cache
def linear_case(name: str):
    """(x [M, K], weights, fused_linear's keyword arguments) of case `name`, K split in `SPLITS`'s slices."""
    x, weights, kw = _linear_case(name)
    return x, weights, {**kw, "tiles": dataclasses.replace(kw["tiles"], splits=SPLITS.get(name, 1))}


def _linear_case(name: str):
    dtype, m, k, layout = LINEAR_CASES[name]
    rng = _rng(name)
    x = _array(rng, (m, k), dtype)
    norm = _array(rng, (k,), dtype, 0.1, 1.0)
    weight = lambda n, dt=dtype: _array(rng, (k, n), dt, 1 / np.sqrt(k))  # noqa: E731
    if layout == "attention":  # q: 3 heads, k: 1, both normed and partly rotated (R 16 of 24); v plain
        cos_sin = _rope(rng, m, 8)
        kw = dict(
            norm=norm,
            biases=tuple(_array(rng, (n,), dtype) for n in (72, 24, 24)),
            head_dim=24,
            head_norms=(_array(rng, (24,), dtype, 0.1, 1.0), _array(rng, (24,), dtype, 0.1, 1.0), None),
            rope=cos_sin,
            rotate=(True, True, False),
            tiles=tiles_with(n=16, k=64, m=16),
        )
        return x, (weight(72), weight(24), weight(24)), kw
    if layout == "latent":  # MLA's: q_a, kv_a's windows: the latent plain, k_pe a rotated (interleaved) head; f32
        kv = weight(32)
        kw = dict(
            windows=(None, (0, 24), (24, 32), None),
            norm=norm,
            head_dim=(None, None, 8, None),
            rope=_rope(rng, m, 4),
            rotate=(False, False, True, False),
            interleave=(False, False, True, False),
            precision="highest",
            tiles=tiles_with(n=16, k=64),
        )
        return x, (weight(40), kv, kv, weight(4, jnp.float32)), kw
    if layout == "latent queries":  # heads of 24 rotated (interleaved) past 16 columns; of 16 from their first
        kw = dict(
            norm=norm,
            head_dim=(24, 16),
            rope=_rope(rng, m, 4),
            rotate=(True, True),
            rope_at=(16, 0),
            interleave=(True, False),
            tiles=tiles_with(n=16, k=16),
        )
        return x, (weight(72), weight(32)), kw
    if layout == "full rotary":  # rotary over whole heads of 16, no norms
        kw = dict(head_dim=16, rope=_rope(rng, m, 8), rotate=(True, True), tiles=tiles_with(n=16, k=16))
        return x, (weight(48), weight(16)), kw
    if layout == "gate_up":  # 36 (gate, up) pairs
        return (
            x,
            (weight(72),),
            dict(norm=norm, biases=(_array(rng, (72,), dtype),), act=silu_glu, tiles=tiles_with(n=32)),
        )
    if layout == "residual":  # 200 output columns over 4 tiles of 64
        kw = dict(
            biases=(_array(rng, (200,), dtype),), residual=_array(rng, (m, 200), dtype), tiles=tiles_with(n=64, k=16)
        )
        return x, (weight(200),), kw
    # the router: its logits, and the normed rows the experts read
    return x, (weight(40, jnp.float32),), dict(norm=norm, normed=True, precision="highest", tiles=tiles_with(n=16))


def numpy_linear(x, weights, *, norm=None, biases=None, residual=None, head_dim=None, head_norms=None, rope=None,
                 rotate=None, rope_at=None, interleave=None, windows=None, act=None, normed=False, **_):  # fmt: skip
    """fused_linear in float64, rounding nothing."""
    f64 = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    h = f64(x)
    if norm is not None:
        h = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS) * f64(norm)
    outs = []
    for i, w in enumerate(weights):
        a, z = windows[i] if windows and windows[i] else (0, w.shape[1])
        y = h @ f64(w)[:, a:z] + (0.0 if biases is None or biases[i] is None else f64(biases[i]))
        if act is not None:
            gate, up = y[:, 0::2], y[:, 1::2]
            y = gate / (1 + np.exp(-gate)) * up
        dh = head_dim[i] if isinstance(head_dim, tuple) else head_dim
        heads = y.reshape(y.shape[0], -1, dh or y.shape[1])
        if head_norms is not None and head_norms[i] is not None:
            heads = heads / np.sqrt(np.mean(heads * heads, axis=-1, keepdims=True) + EPS) * f64(head_norms[i])
        if rotate is not None and rotate[i]:
            cos, sin = (f64(a)[:, None, :] for a in rope)
            half, at = cos.shape[-1], rope_at[i] if rope_at else 0
            rotated = heads[..., at : at + 2 * half]
            x1, x2 = (
                (rotated[..., 0::2], rotated[..., 1::2])
                if interleave and interleave[i]
                else (rotated[..., :half], rotated[..., half:])
            )
            rest = (heads[..., :at], heads[..., at + 2 * half :])
            heads = np.concatenate([rest[0], x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest[1]], axis=-1)
        y = heads.reshape(y.shape)
        outs.append(y if residual is None else y + f64(residual))
    return [h, *outs] if normed else outs


def exactly(f, *args):
    """f(*args) as one program that rounds wherever its code does: XLA otherwise may keep a bf16
    value at float32 between two ops (`xla_allow_excess_precision`), where another program rounds."""
    return jax.jit(f).lower(*args).compile(compiler_options={"xla_allow_excess_precision": False})(*args)


@functools.cache
def linear_runs(name: str):
    """(the kernel's outputs (interpreted), the XLA twin's) for case `name`."""
    x, weights, kw = linear_case(name)
    twin = {key: v for key, v in kw.items() if key != "tiles"}
    return (
        exactly(functools.partial(fused_linear, eps=EPS, interpret=True, **kw), x, weights),
        exactly(functools.partial(fused_linear_xla, eps=EPS, **twin), x, weights),
    )


def tolerance(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)


def assert_same(out, want, exact_bf16: bool = True):
    """Equal outputs: bf16 ones bit for bit (the same roundings; products of bf16 sum exactly in
    float32 at these widths, in any order), float32 ones up to summation order."""
    assert out.shape == want.shape and out.dtype == want.dtype
    if out.dtype == jnp.bfloat16 and exact_bf16:
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    else:
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), **tolerance(out.dtype))


@pytest.mark.parametrize("name", list(LINEAR_CASES))
def test_fused_linear_matches_float64(name):
    """The kernel (interpreted) equals the float64 math, up to the roundings of the rows' dtype."""
    x, weights, kw = linear_case(name)
    outs, _ = linear_runs(name)
    expected = numpy_linear(x, weights, **kw)
    assert len(outs) == len(expected)
    for out, want in zip(outs, expected):
        assert out.shape == want.shape
        np.testing.assert_allclose(np.asarray(out, np.float64), want, **tolerance(x.dtype))


@pytest.mark.parametrize("name", list(LINEAR_CASES))
def test_fused_linear_matches_its_xla_twin(name):
    """The kernel (interpreted) and the XLA twin round at the same points: the same outputs."""
    outs, expected = linear_runs(name)
    assert len(outs) == len(expected)
    for out, want in zip(outs, expected):
        assert_same(out, want)


def test_router_case_multiplies_rows_at_float32():
    """bf16 rows times float32 router weights come out float32 (the router's logits), as the model's
    `x.astype(float32) @ router`; the normed rows beside them in the rows' dtype (the experts')."""
    (normed, logits), _ = linear_runs("router f32 weights bf16 M5")
    assert (normed.dtype, logits.dtype) == (jnp.bfloat16, jnp.float32)


# The model's own functions at a decode step's shapes: [B=2, T=1] rows of D 40, 4 heads of 16
# with R 8 (rotary partial), 2 kv heads.
MODEL = dict(b=2, d=40, h=4, kv=2, dh=16, half=4, f=24)


def model_weights(dtype):
    rng, s = _rng(f"model/{jnp.dtype(dtype).name}"), MODEL
    p = {
        "x": _array(rng, (s["b"], 1, s["d"]), dtype),
        "attn_norm": _array(rng, (s["d"],), dtype, 0.1, 1.0),
        "q": _array(rng, (s["d"], s["h"], s["dh"]), dtype, 0.2),
        "k": _array(rng, (s["d"], s["kv"], s["dh"]), dtype, 0.2),
        "q_bias": _array(rng, (s["h"], s["dh"]), dtype),
        "k_bias": _array(rng, (s["kv"], s["dh"]), dtype),
        "q_norm": _array(rng, (s["dh"],), dtype, 0.1, 1.0),
        "k_norm": _array(rng, (s["dh"],), dtype, 0.1, 1.0),
        "attn": _array(rng, (s["b"], 1, s["h"], s["dh"]), dtype),
        "o": _array(rng, (s["h"], s["dh"], s["d"]), dtype, 0.1),
        "o_bias": _array(rng, (s["d"],), dtype),
        "gate_up": interleave_gate_up(*(_array(rng, (s["d"], s["f"]), dtype, 0.2) for _ in range(2))),
    }
    cos, sin = _rope(rng, s["b"], s["half"])
    return p, (cos[:, None], sin[:, None])  # cos, sin [B, T, R/2]


def assert_twin_is_model(twin, model, dtype, exact_bf16: bool = True):
    """twin(p, cos, sin) and model(p, cos, sin) give the same outputs (`assert_same`)."""
    p, (cos, sin) = model_weights(dtype)
    got, want = exactly(twin, p, cos, sin), exactly(model, p, cos, sin)
    assert len(got) == len(want)
    for out, expected in zip(got, want):
        assert_same(out, expected, exact_bf16)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_xla_twin_is_the_models_attention_projections(dtype):
    """q and k as `gqa` computes them from the layer's input: RMSNorm, the product, the bias, the
    per-head norms, then partial rotate-half RoPE."""
    b, d, h, kv, dh = (MODEL[key] for key in ("b", "d", "h", "kv", "dh"))

    def model(p, cos, sin):
        x = rms_norm(p["x"], p["attn_norm"], EPS)
        qk = [jnp.einsum("btd,dhk->bthk", x, p[name]) + p[name + "_bias"] for name in ("q", "k")]
        qk = [apply_rope(rms_norm(y, p[name + "_norm"], EPS), cos, sin, False) for y, name in zip(qk, "qk")]
        return [y.reshape(b, -1) for y in qk]

    def twin(p, cos, sin):
        return fused_linear_xla(
            p["x"].reshape(b, d),
            (p["q"].reshape(d, h * dh), p["k"].reshape(d, kv * dh)),
            norm=p["attn_norm"],
            eps=EPS,
            biases=(p["q_bias"].reshape(-1), p["k_bias"].reshape(-1)),
            head_dim=dh,
            head_norms=(p["q_norm"], p["k_norm"]),
            rope=(cos[:, 0], sin[:, 0]),
            rotate=(True, True),
        )

    assert_twin_is_model(twin, model, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_xla_twin_is_the_models_latent_queries_and_rope_key(dtype):
    """MLA's queries from its query latent (RMSNorm, q_b, each head's rope part past its first 8
    columns rotated from interleaved pairs) and its rope key out of kv_a's last columns, as
    `attention.mla`'s XLA ops compute them (`apply_rope` with interleave)."""
    b, d, h, dh = (MODEL[key] for key in ("b", "d", "h", "dh"))
    nope = dh - 2 * MODEL["half"]

    def model(p, cos, sin):
        q = jnp.einsum("btd,dhk->bthk", rms_norm(p["x"], p["attn_norm"], EPS), p["q"])
        q = jnp.concatenate([q[..., :nope], apply_rope(q[..., nope:], cos, sin, True)], axis=-1)
        kv = p["x"] @ p["k"].reshape(d, -1)
        k_rope = apply_rope(kv[..., -2 * MODEL["half"] :][:, :, None], cos, sin, True)[:, :, 0]
        return [q.reshape(b, -1), k_rope.reshape(b, -1)]

    def twin(p, cos, sin):
        x, kv = p["x"].reshape(b, d), p["k"].reshape(d, -1)
        rope = (cos[:, 0], sin[:, 0])
        (q,) = fused_linear_xla(
            x, (p["q"].reshape(d, h * dh),), norm=p["attn_norm"], eps=EPS, head_dim=dh, rope=rope, rotate=(True,),
            rope_at=(nope,), interleave=(True,),
        )  # fmt: skip
        (k_rope,) = fused_linear_xla(
            x,
            (kv,),
            head_dim=(8,),
            rope=rope,
            rotate=(True,),
            interleave=(True,),
            windows=((kv.shape[1] - 8, kv.shape[1]),),
        )
        return [q, k_rope]

    assert_twin_is_model(twin, model, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_xla_twin_is_the_models_output_projection_and_residual(dtype):
    """The decoder's x + (attention's heads @ o + o_bias)."""
    b, d, h, dh = (MODEL[key] for key in ("b", "d", "h", "dh"))

    def model(p, cos, sin):
        return [(p["x"] + (jnp.einsum("bthk,hkd->btd", p["attn"], p["o"]) + p["o_bias"])).reshape(b, d)]

    def twin(p, cos, sin):
        return fused_linear_xla(
            p["attn"].reshape(b, h * dh),
            (p["o"].reshape(h * dh, d),),
            biases=(p["o_bias"],),
            residual=p["x"].reshape(b, d),
        )

    assert_twin_is_model(twin, model, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_xla_twin_is_the_models_gate_up_activation(dtype):
    """A dense MLP's (and shared expert's) first half: silu(gate) * up of the normed rows' gate|up
    product, up to one rounding."""
    b, d = MODEL["b"], MODEL["d"]

    def model(p, cos, sin):
        return [silu_glu(*gate_up_columns(rms_norm(p["x"], p["attn_norm"], EPS).reshape(b, d) @ p["gate_up"]))]

    def twin(p, cos, sin):
        return fused_linear_xla(p["x"].reshape(b, d), (p["gate_up"],), norm=p["attn_norm"], eps=EPS, act=silu_glu)

    # The twin (as the kernels) takes the activation's math in float32, the model in bf16.
    assert_twin_is_model(twin, model, dtype, exact_bf16=False)


# scoring: (bias, norm_topk_prob, routed_scaling_factor, M, E, k); logits are small integers (many
# ties), a sigmoid's bias multiples of 1/4 (ties in the biased choice too).
ROUTE_CASES = {
    "softmax": (False, True, 1.0, 5, 40, 6),
    "sigmoid": (True, True, 2.5, 64, 40, 8),
    "topk_softmax": (True, False, 1.0, 1, 32, 4),
}


@functools.cache
def route_case(scoring: str):
    """(logits [M, E] f32, k, topk_route's keyword arguments)."""
    bias, norm, scale, m, e, k = ROUTE_CASES[scoring]
    rng = _rng(f"route/{scoring}")
    logits = jnp.asarray(rng.integers(-3, 3, (m, e)), jnp.float32)
    kw = dict(scoring=scoring, norm_topk_prob=norm, routed_scaling_factor=scale)
    return logits, k, {**kw, "bias": jnp.asarray(rng.integers(0, 4, e) / 4, jnp.float32) if bias else None}


def numpy_route(logits, k, *, scoring, bias, norm_topk_prob, routed_scaling_factor):
    """route in float64; the picks stably sorted (the lowest index first among equal scores)."""
    logits = np.asarray(logits, np.float64)
    bias = 0.0 if bias is None else np.asarray(bias, np.float64)
    if scoring == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores = choice = scores / scores.sum(-1, keepdims=True)
    elif scoring == "topk_softmax":
        scores = choice = logits + bias
    else:
        scores = 1 / (1 + np.exp(-logits))
        choice = scores + bias
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, ids, axis=-1)
    if scoring == "topk_softmax":
        weights = np.exp(weights - weights.max(-1, keepdims=True))
        weights = weights / weights.sum(-1, keepdims=True)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    return ids, weights * routed_scaling_factor, np.take_along_axis(choice, ids, axis=-1)


@functools.cache
def route_runs(scoring: str):
    """((ids, weights) of the kernel (interpreted), of the XLA twin) for case `scoring`."""
    logits, k, kw = route_case(scoring)
    kernel = jax.jit(functools.partial(topk_route, k=k, tiles=ROUTE_TILES, interpret=True, **kw))
    return kernel(logits), jax.jit(functools.partial(topk_route_xla, k=k, **kw))(logits)


@pytest.mark.parametrize("scoring", list(ROUTE_CASES))
def test_topk_route_matches_float64_with_ties(scoring):
    """The kernel (interpreted) picks what a stable sort picks (among equal scores the lowest
    index, as `jax.lax.top_k`), with route's weights."""
    logits, k, kw = route_case(scoring)
    want_ids, want_weights, chosen = numpy_route(logits, k, **kw)
    assert (np.diff(chosen, axis=-1) == 0).any(), "the case has no tie among the picks"
    (ids, weights), _ = route_runs(scoring)
    assert ids.dtype == jnp.int32 and weights.dtype == jnp.float32
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scoring", list(ROUTE_CASES))
def test_topk_route_matches_its_xla_twin(scoring):
    (ids, weights), (want_ids, want_weights) = route_runs(scoring)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scoring", list(ROUTE_CASES))
def test_router_twins_are_route(scoring):
    """The router's product (fused_linear_xla, f32 weights at full precision) and topk_route_xla
    give `route`'s picks and weights exactly."""
    logits, k, kw = route_case(scoring)
    m, e = logits.shape
    rng = _rng(f"router/{scoring}")
    x = _array(rng, (m, 24), jnp.bfloat16)
    p = {"router": _array(rng, (24, e), jnp.float32)}
    if kw["bias"] is not None:
        p["router_bias"] = kw["bias"]
    c = dataclasses.replace(
        preset("tiny"),
        router_scoring=scoring,
        router_bias=kw["bias"] is not None,
        norm_topk_prob=kw["norm_topk_prob"],
        routed_scaling_factor=kw["routed_scaling_factor"],
        num_experts_per_tok=k,
        n_group=1,
        topk_group=1,
    )

    def twin(p, x):
        (router_logits,) = fused_linear_xla(x, (p["router"],), precision="highest")
        return topk_route_xla(router_logits, k, **kw)

    (ids, weights), (want_ids, want_weights) = jax.jit(twin)(p, x), jax.jit(functools.partial(route, c=c))(p, x)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(weights, want_weights)


def compiled_h100(f, *args) -> list[tuple[str, int]]:
    """f compiled for a compile-only H100 over abstract args: (opcode, or a Pallas call's compiler,
    elements written) of each instruction, those fused into fusions included."""
    program = hlo.parse(lower(jax.jit(f), *args).compile().as_text())
    return [(i.pallas or i.opcode, max(map(math.prod, i.shapes), default=0)) for i in program.instrs]


def h100_linear(layout: str, m: int = 4):
    """fused_linear of `layout` as a function of abstract H100 arrays, and the weights' element counts."""
    bf16, f32, k = jnp.bfloat16, jnp.float32, 96
    widths = {
        "attention": (128, 32, 32),
        "latent": (128, 96),  # q_a; kv_a: a latent of 64, a rope key of 32
        "latent queries": (128, 64),  # q_b: heads of 64, rope past 32; the indexer's: heads of 32
        "gate_up": (192,),
        "residual": (96,),
        "router": (64,),
    }[layout]
    wdtype = f32 if layout == "router" else bf16
    args = [on_h100((m, k), bf16), on_h100((k,), bf16), tuple(on_h100((k, n), wdtype) for n in widths)]
    if layout == "attention":
        args += [(on_h100((32,), bf16),) * 2, (on_h100((m, 8), f32),) * 2]
        tiles = tiles_with(num_warps=8, num_stages=3)  # a K pipeline's depth need be no power of two
        call = lambda x, norm, ws, hn, rope: fused_linear(  # noqa: E731
            x, ws, norm=norm, head_dim=32, head_norms=(*hn, None), rope=rope, rotate=(True, True, False), tiles=tiles
        )
    elif layout == "latent":
        args.append((on_h100((m, 16), f32),) * 2)
        call = lambda x, norm, ws, rope: fused_linear(  # noqa: E731
            x, (ws[0], ws[1], ws[1]), norm=norm, head_dim=(None, None, 32), rope=rope, rotate=(False, False, True),
            interleave=(False, False, True), windows=(None, (0, 64), (64, 96)), tiles=tiles_with(),
        )  # fmt: skip
    elif layout == "latent queries":
        args.append((on_h100((m, 8), f32),) * 2)
        call = lambda x, norm, ws, rope: fused_linear(  # noqa: E731
            x, ws, norm=norm, head_dim=(64, 32), rope=rope, rotate=(True, True), rope_at=(32, 0),
            interleave=(True, True), tiles=tiles_with(),
        )  # fmt: skip
    elif layout == "gate_up":
        call = lambda x, norm, ws: fused_linear(x, ws, norm=norm, act=silu_glu, tiles=tiles_with())  # noqa: E731
    elif layout == "residual":
        args.append(on_h100((m, 96), bf16))
        call = lambda x, norm, ws, res: fused_linear(x, ws, residual=res, tiles=tiles_with())  # noqa: E731
    else:
        call = lambda x, norm, ws: fused_linear(  # noqa: E731
            x, ws, norm=norm, normed=True, precision="highest", tiles=tiles_with()
        )
    return call, args, {k * n for n in widths}


@pytest.mark.parametrize("layout", ["attention", "latent", "latent queries", "gate_up", "residual", "router"])
def test_fused_linear_compiles_for_h100_to_one_launch(layout):
    """Triton compiles the kernel for an H100, and the program is that one kernel: nothing but
    parameters and bitcasts beside it, so no op writes a temporary of a weight's shape."""
    call, args, weight_sizes = h100_linear(layout)
    ops = compiled_h100(call, *args)
    assert [op for op, _ in ops].count(TRITON) == 1
    assert {op for op, _ in ops} <= {TRITON, "parameter", "bitcast"}
    assert not [op for op, size in ops if op not in ("parameter", "bitcast") and size in weight_sizes]


def test_topk_route_compiles_for_h100_to_one_launch():
    """At E 512 and k 16 (the largest routers), a biased sigmoid with the weights normalized."""
    ops = compiled_h100(
        lambda logits, bias: topk_route(
            logits, 16, scoring="sigmoid", bias=bias, norm_topk_prob=True, tiles=ROUTE_TILES
        ),
        on_h100((16, 512), jnp.float32),
        on_h100((512,), jnp.float32),
    )
    assert [op for op, _ in ops].count(TRITON) == 1
    assert {op for op, _ in ops} <= {TRITON, "parameter", "bitcast"}


def _linear_args(**kw):
    x, weights = jnp.zeros((3, 8), jnp.float32), (jnp.zeros((8, 32), jnp.float32),)
    return {"x": x, "weights": weights, "tiles": tiles_with(), **kw}


BAD_LINEAR = {
    "rows not [M, K]": (_linear_args(x=jnp.zeros((3, 1, 8))), "rows must be"),
    "a weight's K": (_linear_args(weights=(jnp.zeros((9, 32)),)), "must be \\[K=8, N\\]"),
    "biases per segment": (_linear_args(biases=(None, None)), "biases has 2 entries for 1"),
    "partial heads": (_linear_args(head_dim=24, head_norms=(jnp.ones(24),)), "not whole heads of 24"),
    "rope wider than a head": (
        _linear_args(head_dim=8, rope=(jnp.ones((3, 8)),) * 2, rotate=(True,)),
        "R columns from rope_at=0 within head_dim=8",
    ),
    "rope past a head's end": (
        _linear_args(head_dim=8, rope=(jnp.ones((3, 2)),) * 2, rotate=(True,), rope_at=(6,)),
        "R columns from rope_at=6 within head_dim=8",
    ),
    "a window past its weight": (_linear_args(windows=((16, 40),)), "a window must be columns"),
    "head widths per segment": (_linear_args(head_dim=(8, 8), head_norms=(jnp.ones(8),)), "head_dim has 2 entries"),
    "interleaved rope after a head norm": (
        _linear_args(
            head_dim=8, head_norms=(jnp.ones(8),), rope=(jnp.ones((3, 2)),) * 2, rotate=(True,), interleave=(True,)
        ),
        "an interleaved rope's segment has",
    ),
    "rope without a segment": (_linear_args(head_dim=8, rope=(jnp.ones((3, 4)),) * 2), "rotate names no segment"),
    "act over two segments": (_linear_args(weights=(jnp.zeros((8, 32)),) * 2, act=silu_glu), "act takes one"),
    "residual's shape": (_linear_args(residual=jnp.zeros((3, 16))), "a residual goes with one segment"),
    "precision": (_linear_args(precision="high"), "precision must be one of"),
    "tile not a power of two": (_linear_args(tiles=tiles_with(n=24)), "tiles.n must be a power of two"),
}


@pytest.mark.parametrize("case", list(BAD_LINEAR))
def test_fused_linear_refuses_bad_input_with_one_error(case):
    kw, message = dict(BAD_LINEAR[case][0]), BAD_LINEAR[case][1]
    with pytest.raises(ValueError, match=message):
        fused_linear(kw.pop("x"), kw.pop("weights"), interpret=True, **kw)


BAD_ROUTE = {
    "scoring": (dict(scoring="sparsemax"), "scoring must be one of"),
    "bias with softmax": (dict(scoring="softmax", bias=jnp.zeros(16)), "goes with sigmoid or topk_softmax"),
    "k past E": (dict(scoring="sigmoid", k=17), "k=17 picks out of E=16"),
    "bf16 logits": (dict(scoring="sigmoid", logits=jnp.zeros((2, 16), jnp.bfloat16)), "float32"),
}


@pytest.mark.parametrize("case", list(BAD_ROUTE))
def test_topk_route_refuses_bad_input_with_one_error(case):
    kw, message = BAD_ROUTE[case]
    kw = {"logits": jnp.zeros((2, 16), jnp.float32), "k": 4, **kw}  # a copy: the case stays
    with pytest.raises(ValueError, match=message):
        topk_route(kw.pop("logits"), kw.pop("k"), tiles=ROUTE_TILES, interpret=True, **kw)
