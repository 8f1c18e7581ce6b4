"""A layer's dense products: XLA's ops, or the fused decode kernels where the placement runs them.

Every platform multiplies a prefill chunk's rows, and a decode step's on XLA:CPU, with the XLA ops
written here (an RMSNorm, then einsums). A decode step on a GPU is a few rows against
every weight of a layer: there XLA:GPU made each projection a multiply whose output has the
weight's own shape, then a reduce, and each norm, rotary embedding, router top-k and residual add
a kernel of its own, 47 launches a layer. Where the placement says so (`DecodeKernels.fuses_dense`), each group
of products is one kernel (`pallas_kernels/linear.py`) that reads its weights once:

- attention's q, k and v: the input RMSNorm, the three projections, the q/k norms and the rotary
  embedding (`qkv`);
- MLA's (DeepSeek-V3, GLM-5) in two: the normed rows times q_a, kv_a's latent and its rotated rope
  key, and a DSA indexer's keys and head weights; then the query latent, normed, times q_b (each
  head's rope part rotated) and the indexer's queries (`latent`), where the set's dense kernel takes
  their epilogues (`catalog.Kernel.latent_heads`: Triton's);
- attention's output projection with the residual add (`out`, MLA's too);
- the router: the MoE's input RMSNorm and the logits, then top-k and the picks' weights (`route`);
- a dense MLP (or shared expert): gate|up with the gated activation, then down with the residual add.

A TPU's decode set, and Hopper's Mosaic GPU one, have the router alone as one kernel
(`pallas_kernels/route_tpu.py`, `route_mgpu.py`: the norm, the float32 logits, top-k and the
weights; `DecodeKernels.routes`); a TPU's has q|k|v and the output projection as one each
(`pallas_kernels/linear_tpu.py`), their weights read in their run's stacks and their model's shapes.

A kernel is one device's program. On a mesh each device runs it on its own rows (`DecodeKernels.run`:
the placement's shard_map, rows split as the batch is) by the weights it holds, so a group runs in
the kernels only where its weights lie whole on every device (`DecodeKernels.dense`): attention's
under DP attention, the router's always, an MLP's where the layout replicates it.

Both paths compute the same values (`tests/test_decode_kernels.py`); the kernels round where the XLA
ops do.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.base.platform import DecodeKernels
from moejax.config import ModelConfig
from moejax.model import dsa, paged
from moejax.model.layers import apply_rope, rms_norm, silu_glu
from moejax.model.router import route as xla_route
from pallas_kernels import layered
from pallas_kernels.epilogue import gate_up_columns


def dense_widths(c: ModelConfig, group: str) -> list[tuple[int, int, bool]]:
    """(K, N, gated) of each product of dense group `group` (`platform.DENSE_GROUPS`), a head's
    pieces among them as N (the rotated halves, the rest: a head epilogue's columns): the widths a
    dense kernel's shape check reads."""
    d = c.hidden_size
    if group == "attention":
        if c.is_mla:
            return _latent_widths(c)
        h, kv, dh, r = c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim
        pieces = [(d, w, False) for w in (r // 2, dh - r) if w]
        return [(d, (h + 2 * kv) * dh, False), (h * dh, d, False), *pieces]
    if group == "router":
        return [(d, c.num_experts, False)]
    f = c.intermediate_size if group == "mlp" else c.moe_intermediate_size * c.num_shared_experts
    return [(d, 2 * f, True), (f, d, False)] if f else []


def _latent_widths(c: ModelConfig) -> list[tuple[int, int, bool]]:
    """`dense_widths` of MLA's attention (`latent`, `out`): the rows' product (q_a or q, kv_a, and a
    DSA indexer's keys and head weights), the query latent's (q_b, the indexer's queries), the output
    projection; the heads' pieces."""
    d, h, r = c.hidden_size, c.num_heads, c.qk_rope_head_dim
    index = (c.index_head_dim + c.index_n_heads, c.index_n_heads * c.index_head_dim) if c.is_dsa else (0, 0)
    first = c.q_lora_rank or h * c.qk_head_dim
    products = [(d, first + c.kv_lora_rank + r + index[0]), (h * c.v_head_dim, d)]
    if c.q_lora_rank:
        products.append((c.q_lora_rank, h * c.qk_head_dim + index[1]))
    pieces = [c.qk_nope_head_dim, r // 2, c.index_head_dim - r if c.is_dsa else 0]
    return [(k, n, False) for k, n in products] + [(d, w, False) for w in pieces if w]


def _fused(decode: DecodeKernels, x: jax.Array, weights: tuple, *, residual=None, rope=None, **kw) -> tuple:
    """The decode set's dense kernel (`pallas_kernels.fused_linear`) of rows x [M, K] and weight
    segments, on each device's rows (`DecodeKernels.run`; residual [M, N] and rope's cos, sin
    [M, R/2] are rows too). Its segments with a head epilogue (head norms, rope) take a program per
    head, the rest the table's column tile, unless K splits (then every column takes the tile, in
    each slice: the epilogue runs on the slices' sum). kw: the kernel's other arguments, its arrays
    (norm, biases, head_norms) whole."""
    import pallas_kernels  # the kernels, loaded where they run
    from pallas_kernels.linear_segments import columns

    arrays = {name: kw.pop(name) for name in ("norm", "biases", "head_norms") if name in kw}
    count = len(weights)
    windows = kw.get("windows") or (None,) * count
    widths = [
        columns(w, x.shape[1]) if window is None else window[1] - window[0] for w, window in zip(weights, windows)
    ]
    head_dims = kw.get("head_dim")
    head_dims = head_dims if isinstance(head_dims, tuple) else (head_dims,) * count
    heads = [
        dh if hn is not None or rot else 0
        for dh, hn, rot in zip(head_dims, arrays.get("head_norms") or (None,) * count, kw.get("rotate") or (0,) * count)
    ]

    def programs(tn: int, splits: int) -> int:  # the kernel's layout: a head a program, unless K splits
        if splits > 1:
            return sum(-(-w // tn) for w in widths) * splits
        return sum(w // dh if dh else -(-w // tn) for w, dh in zip(widths, heads))

    def kernel(rows, whole):  # one device's rows
        (x, residual, rope), (weights, arrays) = rows, whole
        return pallas_kernels.fused_linear(
            x,
            weights,
            backend=decode.linear,
            device=decode.device,
            programs=programs,
            residual=residual,
            rope=rope,
            precision=decode.precision,
            **arrays,
            **kw,
        )

    return decode.run(kernel, (x, residual, rope), (weights, arrays))


# Attention's weights its dense kernel reads (`qkv`, `out`): a TPU's in their run's stacks (`layered.LayerOf`).
ATTENTION_WEIGHTS = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm")


def _shaped(decode: DecodeKernels, w, flat: tuple):
    """Weight (or rows of heads) w as the decode set's dense kernel reads it: in its model's shape where
    the kernel reads a layer in its stack (a TPU's, whose reshape of a tiled [D, H, Dh] is a copy), else
    reshaped to `flat`."""
    return w if decode.linear_reads_stacks else w.reshape(flat)


@jax.named_scope("qkv")  # `moejax trace` and the compiled-program checks find its ops
def qkv(decode: DecodeKernels, p: dict, x: jax.Array, norm: jax.Array, cos_sin, c: ModelConfig, interleave=False):
    """x: [B, T, D] the residual stream, `norm` the layer's attention norm -> q [B, T, H, Dh],
    k, v [B, T, H_kv, Dh]: normed rows projected, biased, q and k normed per head and rotated;
    `interleave`: k|v as the interleaved page pool's rows [B, T, 2 * H_kv, Dh] in k's place (a TPU's
    dense kernel writes them so: its interleave of k and v was two ops a layer), v None."""
    b, t, d = x.shape
    cos, sin = cos_sin
    if not decode.fuses_dense(b * t, "attention"):
        # The kernel's weights may lie in their run's stacks (`layered.LayerOf`); XLA's ops slice them.
        norm, p = layered.resolved(norm), {k: layered.resolved(w) for k, w in p.items()}
        h = rms_norm(x, norm, c.rms_norm_eps)
        q = jnp.einsum("btd,dhk->bthk", h, p["q"])
        k = jnp.einsum("btd,dhk->bthk", h, p["k"])
        v = jnp.einsum("btd,dhk->bthk", h, p["v"])
        if c.attention_bias:
            q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
        if c.qk_norm:
            q, k = rms_norm(q, p["q_norm"], c.rms_norm_eps), rms_norm(k, p["k_norm"], c.rms_norm_eps)
        q, k = apply_rope(q, cos, sin, c.rope_interleave), apply_rope(k, cos, sin, c.rope_interleave)
        return (q, paged.interleaved(k, v), None) if interleave else (q, k, v)
    names = ("q", "k", "v")
    weights = tuple(_shaped(decode, p[n], (d, -1)) for n in names)
    biases = tuple(_shaped(decode, p[n + "_bias"], (-1,)) for n in names) if c.attention_bias else None
    head_norms = (p["q_norm"], p["k_norm"], None) if c.qk_norm else None
    outs = _fused(
        decode,
        x.reshape(b * t, d),
        weights,
        norm=norm,
        eps=c.rms_norm_eps,
        biases=biases,
        head_dim=c.head_dim,
        head_norms=head_norms,
        rope=(cos.reshape(b * t, -1), sin.reshape(b * t, -1)),
        rotate=(True, True, False),
        out_dtype=x.dtype,
        **({"interleave": True} if interleave else {}),  # the TPU's dense kernel's (a combined pool's set)
    )
    q, k, *v = (y.reshape(b, t, -1, c.head_dim) for y in outs)
    return q, k, (v or [None])[0]


class Latent(NamedTuple):
    """MLA's projections of a layer's rows (`latent`)."""

    q_nope: jax.Array  # [B, T, H, Dn]
    q_rope: jax.Array  # [B, T, H, R], rotated
    latent: jax.Array  # [B, T, R_kv], normed: the cached latent
    k_rope: jax.Array  # [B, T, R], rotated: the rope key all heads share
    # DSA: (the indexer's keys [B, T, Dk], queries [B, T, H_i, Dk], head weights float32 [B, T, H_i]), else None
    index: tuple | None


@jax.named_scope("latent")
def latent(decode: DecodeKernels, p: dict, residual: jax.Array, norm: jax.Array, cos_sin, c: ModelConfig) -> Latent:
    """MLA's (DeepSeek's) projections of residual [B, T, D], `norm` the layer's attention norm, and a
    DSA layer's indexer's (`p["indexer"]`). In the kernels, two launches: the normed rows times q_a
    (or a plain q's rotated heads), kv_a's latent and rotated rope key, the indexer's keys and head
    weights; then the query latent, RMS-normed, times q_b (each head's rope part rotated) and the
    indexer's queries (rotated). The latent's RMSNorm and the indexer keys' LayerNorm and rope stay
    XLA's ops: a whole-row norm over a segment is one program's columns, which would read all of
    the weight's [D, 512] alone."""
    b, t, d = residual.shape
    cos, sin = cos_sin
    nope, r, lr, eps = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.rms_norm_eps
    indexer = p.get("indexer")
    if not decode.fuses_dense(b * t, "attention"):
        x = rms_norm(residual, norm, eps)
        if c.q_lora_rank:
            q_lat = rms_norm(x @ p["q_a"], p["q_a_norm"], eps)
            q = jnp.einsum("btr,rhk->bthk", q_lat, p["q_b"])
        else:
            q = jnp.einsum("btd,dhk->bthk", x, p["q"])
        kv = x @ p["kv_a"]
        latent = rms_norm(kv[..., :lr], p["kv_a_norm"], eps)
        k_rope = apply_rope(kv[..., lr:][:, :, None], cos, sin, c.rope_interleave)[:, :, 0]
        q_rope = apply_rope(q[..., nope:], cos, sin, c.rope_interleave)
        index = None
        if indexer is not None:
            keys = dsa.index_keys(indexer, x @ indexer["wk"], cos_sin)
            index = (keys, *dsa.index_queries(indexer, x, q_lat, cos_sin))
        return Latent(q[..., :nope], q_rope, latent, k_rope, index)
    rows = lambda a: a.reshape(b * t, -1)  # noqa: E731
    rope = (rows(cos), rows(sin))
    h, qk, interleave = c.num_heads, c.qk_head_dim, c.rope_interleave
    kv = p["kv_a"]  # the latent's columns, then the rope key's: one weight, two segments' windows
    first = [
        _Seg(p["q_a"]) if c.q_lora_rank else _Seg(p["q"].reshape(d, -1), qk, nope, interleave),
        _Seg(kv, window=(0, lr)),
        _Seg(kv, r, 0, interleave, window=(lr, lr + r)),
    ]
    if indexer is not None:
        first += [_Seg(indexer["wk"]), _Seg(indexer["head_weights"])]
    outs = _segments(decode, rows(residual), first, rope, norm=norm, eps=eps)
    q, latent, k_rope = outs[:3]
    if c.q_lora_rank:
        second = [_Seg(p["q_b"].reshape(c.q_lora_rank, -1), qk, nope, interleave)]
        if indexer is not None:  # the indexer's rope: interleaved, on each head's first columns
            second.append(_Seg(indexer["wq"].reshape(c.q_lora_rank, -1), c.index_head_dim, 0, True))
        q, *index_q = _segments(decode, q, second, rope, norm=p["q_a_norm"], eps=eps)
    q = q.reshape(b, t, h, qk)
    index = None
    if indexer is not None:
        keys = dsa.index_keys(indexer, outs[3].reshape(b, t, -1), cos_sin)
        index = (keys, index_q[0].reshape(b, t, c.index_n_heads, -1), outs[4].reshape(b, t, -1))
    latent = rms_norm(latent.reshape(b, t, lr), p["kv_a_norm"], eps)
    return Latent(q[..., :nope], q[..., nope:], latent, k_rope.reshape(b, t, r), index)


class _Seg(NamedTuple):
    """A weight segment of `_segments`: weight [K, N], its heads' width (None: no head epilogue), the
    first rotated column of a head (None: not rotated), whether its rope's pairs are interleaved, and
    the window of its columns it multiplies (None: all)."""

    weight: jax.Array
    head: int | None = None
    rope_at: int | None = None
    interleave: bool = False
    window: tuple[int, int] | None = None


def _segments(decode: DecodeKernels, x: jax.Array, segs: list, rope, **kw) -> tuple:
    """`_fused` of rows x [M, K] and segments `segs` (`_Seg`), rope (cos, sin) [M, R/2] where one
    rotates; each output in its product's dtype."""
    rotate = tuple(seg.rope_at is not None for seg in segs)
    return _fused(
        decode,
        x,
        tuple(seg.weight for seg in segs),
        windows=tuple(seg.window for seg in segs),
        head_dim=tuple(seg.head for seg in segs),
        rope=rope if any(rotate) else None,
        rotate=rotate,
        rope_at=tuple(seg.rope_at or 0 for seg in segs),
        interleave=tuple(seg.interleave for seg in segs),
        **kw,
    )


@jax.named_scope("out")
def out(decode: DecodeKernels, p: dict, attended: jax.Array, residual: jax.Array, c: ModelConfig) -> jax.Array:
    """attended: [B, T, H, Dh] -> residual + its output projection (+ bias): [B, T, D]."""
    b, t, h, dh = attended.shape
    if not decode.fuses_dense(b * t, "attention"):
        p = {k: layered.resolved(w) for k, w in p.items()}
        y = jnp.einsum("bthk,hkd->btd", attended, p["o"])
        return residual + (y + p["o_bias"] if c.o_bias else y)
    (y,) = _fused(
        decode,
        _shaped(decode, attended.reshape(b * t, h, dh), (b * t, h * dh)),  # a TPU's: its heads as attention wrote them
        (_shaped(decode, p["o"], (h * dh, -1)),),
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
    weighing = dict(norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor)
    bias = p["router_bias"] if c.router_bias else None
    if forced is None and not grouped and decode.routes(x.shape[0]):
        import pallas_kernels  # the kernels, loaded where they run

        def kernel(rows, whole):  # one device's rows
            (x,), (norm, router, bias) = rows, whole
            return pallas_kernels.route(
                x,
                norm,
                router,
                backend=decode.router,
                device=decode.device,
                k=c.num_experts_per_tok,
                eps=c.rms_norm_eps,
                scoring=c.router_scoring,
                bias=bias,
                precision=decode.precision,
                # The experts' slot table is one device's, which holds every expert: on a mesh XLA's.
                slots=decode.per_device is None,
                **weighing,
            )

        return decode.run(kernel, (x,), (norm, p["router"], bias))
    # The kernel's norm and router may lie in their run's stack (`layered.LayerOf`); XLA's slice them.
    norm, p = layered.resolved(norm), {**p, "router": layered.resolved(p["router"])}
    if forced is not None or grouped or not decode.fuses_dense(x.shape[0], "router"):
        h = rms_norm(x, norm, c.rms_norm_eps)
        return (h, *xla_route(p, h, c, forced), None)
    import pallas_kernels  # the kernels, loaded where they run

    h, logits = _fused(decode, x, (p["router"],), norm=norm, eps=c.rms_norm_eps, normed=True)

    def top_k(rows, whole):  # one device's rows
        (logits,), (bias,) = rows, whole
        return pallas_kernels.topk_route(
            logits,
            c.num_experts_per_tok,
            backend=decode.topk,
            device=decode.device,
            scoring=c.router_scoring,
            bias=bias,
            **weighing,
        )

    return (h, *decode.run(top_k, (logits,), (bias,)), None)


@jax.named_scope("mlp")
def mlp(placement, p: dict, h: jax.Array, residual: jax.Array | None = None, group: str = "mlp") -> jax.Array:
    """A SwiGLU MLP on normed rows h: [..., D] through gate_up [D, 2F] and down [F, D] (+ residual);
    `group`: whose weights they are ("mlp": a dense layer's, "shared_mlp": the shared experts', the
    logical axis of their F), as `placement` lays them out and runs them."""
    decode = placement.decode
    if not decode.fuses_dense(h.size // h.shape[-1], group):
        g = silu_glu(*gate_up_columns(h @ p["gate_up"]))  # [..., F]
        if not placement.lies_whole(group):
            # F sliced over the devices: each multiplies every row by its columns, and `down`'s
            # partial sums meet in a reduce-scatter. Left to itself, XLA gathered the rows' share of
            # F and the whole down weight to each device every layer (GLM-5.3: 25 MB a MoE layer).
            g = placement.constrain(g, (*[None] * (g.ndim - 1), group))
            # Kept out of down's fusion: XLA:GPU's Triton GEMM fusion tiles a slice's gate and up
            # columns (stride-2 slices) wrongly and aborts the process (jaxlib 0.10.2,
            # triton_tiling_propagation.cc "subdim_size_accumulator == dim_size").
            g = jax.lax.optimization_barrier(g)
        y = g @ p["down"]
        return y if residual is None else residual + y
    rows = h.reshape(-1, h.shape[-1])
    (g,) = _fused(decode, rows, (p["gate_up"],), act=silu_glu, out_dtype=h.dtype)
    res = None if residual is None else residual.reshape(rows.shape[0], -1)
    (y,) = _fused(decode, g, (p["down"],), residual=res, out_dtype=h.dtype)
    return y.reshape(h.shape)
