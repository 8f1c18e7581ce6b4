"""A layer's dense products: XLA's ops, or the GPU's fused decode kernels where the placement runs them.

Every platform multiplies a prefill chunk's rows, and a decode step's on XLA:CPU and TPUs, with the
XLA ops written here (an RMSNorm, then einsums). A decode step on a GPU is a few rows against
every weight of a layer: there XLA:GPU made each projection a multiply whose output has the
weight's own shape, then a reduce, and each norm, rotary embedding, router top-k and residual add
a kernel of its own, 47 launches a layer. Where the placement says so (`DecodeKernels.fuses_dense`), each group
of products is one kernel (`pallas_kernels/linear.py`) that reads its weights once:

- attention's q, k and v: the input RMSNorm, the three projections, the q/k norms and the rotary
  embedding (`qkv`);
- attention's output projection with the residual add (`out`);
- the router: the MoE's input RMSNorm and the logits, then top-k and the picks' weights (`route`);
- a dense MLP (or shared expert): gate|up with the gated activation, then down with the residual add.

A TPU's decode set has the router alone as one kernel (`pallas_kernels/route_tpu.py`: the norm, the
logits, top-k and the weights; `DecodeKernels.routes`), on one device.

Both paths compute the same values (`tests/test_decode_kernels.py`); the kernels round where the XLA
ops do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.base.platform import DecodeKernels
from moejax.config import ModelConfig
from moejax.model.layers import apply_rope, rms_norm, silu_glu
from moejax.model.router import route as xla_route
from pallas_kernels import layered
from pallas_kernels.epilogue import gate_up_columns


def _fused(decode: DecodeKernels, x: jax.Array, weights: tuple, *, heads: int = 0, **kw) -> tuple:
    """`linear.fused_linear` of rows x [M, K] and weight segments, its tiles from the decode table for
    the call's shape on the run's device; `heads`: the columns of the segments with a head epilogue,
    a program each per head (the rest take the table's column tile), unless K splits (then every
    column takes the tile, in each slice: the epilogue runs on the slices' sum)."""
    from pallas_kernels import linear, tiles  # the kernels' modules, loaded where they run

    n = sum(w.shape[1] for w in weights)
    head_dim = kw.get("head_dim") or 1
    itemsize = weights[0].dtype.itemsize

    def programs(tn: int, splits: int) -> int:  # the kernel's layout: a head a program, unless K splits
        if splits > 1:
            return sum(-(-w.shape[1] // tn) for w in weights) * splits
        return heads // head_dim + -(-(n - heads) // tn)

    chosen = tiles.lookup(
        "fused_linear",
        decode.device,
        rows=x.shape[0],
        k=x.shape[1],
        n=n,
        fmt="f32" if weights[0].dtype == jnp.float32 else "bf16",
        programs=programs,
        # The N tile narrows to 128 bytes of a weight row (a memory transaction), no slivers; past that K splits.
        tn_floor=128 // itemsize,
        n_field="n",
        k_field="k",
        # The slices' f32 partials, written and read back (8 bytes a row and column a slice), at most
        # an eighth of the weight's bytes: splits at batch 1, few or none at 64 rows.
        max_splits=max(1, x.shape[1] * itemsize // (64 * x.shape[0])),
    )
    return linear.fused_linear(
        x, weights, tiles=linear.Tiles(**chosen), precision=decode.precision, interpret=decode.interpret, **kw
    )


@jax.named_scope("qkv")  # `moejax trace` and the compiled-program checks find its ops
def qkv(decode: DecodeKernels, p: dict, x: jax.Array, norm: jax.Array, cos_sin, c: ModelConfig):
    """x: [B, T, D] the residual stream, `norm` the layer's attention norm -> q [B, T, H, Dh],
    k, v [B, T, H_kv, Dh]: normed rows projected, biased, q and k normed per head and rotated."""
    b, t, d = x.shape
    cos, sin = cos_sin
    if not decode.fuses_dense(b * t):
        h = rms_norm(x, norm, c.rms_norm_eps)
        q = jnp.einsum("btd,dhk->bthk", h, p["q"])
        k = jnp.einsum("btd,dhk->bthk", h, p["k"])
        v = jnp.einsum("btd,dhk->bthk", h, p["v"])
        if c.attention_bias:
            q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
        if c.qk_norm:
            q, k = rms_norm(q, p["q_norm"], c.rms_norm_eps), rms_norm(k, p["k_norm"], c.rms_norm_eps)
        return apply_rope(q, cos, sin, c.rope_interleave), apply_rope(k, cos, sin, c.rope_interleave), v
    names = ("q", "k", "v")
    weights = tuple(p[n].reshape(d, -1) for n in names)
    biases = tuple(p[n + "_bias"].reshape(-1) for n in names) if c.attention_bias else None
    head_norms = (p["q_norm"], p["k_norm"], None) if c.qk_norm else None
    q, k, v = _fused(
        decode,
        x.reshape(b * t, d),
        weights,
        heads=sum(w.shape[1] for w in weights[:2]),
        norm=norm,
        eps=c.rms_norm_eps,
        biases=biases,
        head_dim=c.head_dim,
        head_norms=head_norms,
        rope=(cos.reshape(b * t, -1), sin.reshape(b * t, -1)),
        rotate=(True, True, False),
        out_dtype=x.dtype,
    )
    return tuple(y.reshape(b, t, -1, c.head_dim) for y in (q, k, v))


@jax.named_scope("out")
def out(decode: DecodeKernels, p: dict, attended: jax.Array, residual: jax.Array, c: ModelConfig) -> jax.Array:
    """attended: [B, T, H, Dh] -> residual + its output projection (+ bias): [B, T, D]."""
    b, t, h, dh = attended.shape
    if not decode.fuses_dense(b * t):
        y = jnp.einsum("bthk,hkd->btd", attended, p["o"])
        return residual + (y + p["o_bias"] if c.o_bias else y)
    (y,) = _fused(
        decode,
        attended.reshape(b * t, h * dh),
        (p["o"].reshape(h * dh, -1),),
        biases=(p["o_bias"],) if c.o_bias else None,
        residual=residual.reshape(b * t, -1),
        out_dtype=residual.dtype,
    )
    return y.reshape(residual.shape)


@jax.named_scope("router")
def route(decode: DecodeKernels, p: dict, x: jax.Array, norm: jax.Array, c: ModelConfig, forced=None):
    """x: [T, D] the residual stream's rows, `norm` the layer's MLP norm -> (h [T, D] the normed
    rows the experts multiply, ids int32 [T, k], weights float32 [T, k], the experts kernel's slot
    table int32 [E] where the router kernel writes it, else None) as `router.route` picks. The
    kernels take no routing override (`forced`) nor DeepSeek's group stage: XLA does."""
    grouped = c.n_group > 1 and c.topk_group < c.n_group
    if forced is None and not grouped and decode.routes(x.shape[0]):
        import pallas_kernels  # the kernels, loaded where they run

        return pallas_kernels.route(
            x,
            norm,
            p["router"],
            backend=decode.router,
            k=c.num_experts_per_tok,
            eps=c.rms_norm_eps,
            scoring=c.router_scoring,
            bias=p["router_bias"] if c.router_bias else None,
            norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor,
            precision=decode.precision,
        )
    # The kernel's norm and router may lie in their run's stack (`layered.LayerOf`); XLA's slice them.
    norm, p = layered.resolved(norm), {**p, "router": layered.resolved(p["router"])}
    if forced is not None or grouped or not decode.fuses_dense(x.shape[0]):
        h = rms_norm(x, norm, c.rms_norm_eps)
        return (h, *xla_route(p, h, c, forced), None)
    from pallas_kernels import routing, tiles

    h, logits = _fused(decode, x, (p["router"],), norm=norm, eps=c.rms_norm_eps, normed=True)
    ids, weights = routing.topk_route(
        logits,
        c.num_experts_per_tok,
        scoring=c.router_scoring,
        bias=p["router_bias"] if c.router_bias else None,
        norm_topk_prob=c.norm_topk_prob,
        routed_scaling_factor=c.routed_scaling_factor,
        tiles=routing.Tiles(**tiles.lookup("topk_route", decode.device)),
        interpret=decode.interpret,
    )
    return h, ids, weights, None


@jax.named_scope("mlp")
def mlp(decode: DecodeKernels, p: dict, h: jax.Array, residual: jax.Array | None = None) -> jax.Array:
    """A SwiGLU MLP on normed rows h: [..., D] through gate_up [D, 2F] and down [F, D] (+ residual)."""
    if not decode.fuses_dense(h.size // h.shape[-1]):
        y = silu_glu(*gate_up_columns(h @ p["gate_up"])) @ p["down"]
        return y if residual is None else residual + y
    rows = h.reshape(-1, h.shape[-1])
    (g,) = _fused(decode, rows, (p["gate_up"],), act=silu_glu, out_dtype=h.dtype)
    res = None if residual is None else residual.reshape(rows.shape[0], -1)
    (y,) = _fused(decode, g, (p["down"],), residual=res, out_dtype=h.dtype)
    return y.reshape(h.shape)
