"""A TPU decode step's dense products as one Mosaic TPU kernel each: `fused_linear`'s twin of
`linear.py` (Triton) for a decode step's rows (at most 128).

A TPU core runs a program's ops one after another, and XLA made attention's q|k|v some nineteen of
them a layer (the input RMSNorm, the products, the q and k head norms, the rotary embedding, each a
fusion), the output projection and its residual add two more. Here a call reads rows x [M, K] whole
(RMS-normed once, at the first grid step, into VMEM) and walks its weight segments' column blocks,
one grid step each, the pipeline fetching the next block while this one multiplies; each block's
epilogue runs on the f32 product in VMEM: the bias, then per head the RMSNorm and the rotate-half
rotary embedding (attention's q and k), or a residual added.

A weight is read in its own shape, and a layer of a run's stack where it lies (`layered.LayerOf`:
under the layer scan a layer sliced out of its stack is a copy for a kernel's operand, and on a TPU
a reshape of [D, H, Dh] to [D, H * Dh] is one too: the last two dims are its tiled ones). So a
segment is [K, N] (column blocks of `Tiles.n`), [K, H, Dh] (q, k, v: blocks of whole heads, each
head its own product) or [H, Dh, N] (the output projection, K = H * Dh: column blocks). The
vectors (the norm, head norms, biases' stacks [L, N]) are small: read whole, their layer's row
picked in VMEM (a one-row block of a stack is no whole sublane tile). For the same reason its
rows meet attention in attention's layouts: q comes out as heads [M, H, Dh], k and v as one
[M, 2 * H_kv, Dh] of the interleaved page pool's rows (`interleave`), and the output projection
takes attention's heads [M, H, Dh] as they lie (on a v5e each relayout was an op a layer).

bf16 rows and weights multiply in bf16 with f32 sums; float32 ones in float32 at the run's precision
("highest": float32 products, not one bf16 pass). The gated activation (a dense MLP's, the shared
experts') is not here: the catalog's shape check refuses a gated product, which keeps XLA's ops.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import epilogue, layered, metadata
from pallas_kernels.linear_segments import PRECISIONS, check_normed, normalize, rotate_half, segments, uniform_heads

LANES = 128
# `registry.fused_linear` narrows a K step to no less than this where it splits K; this kernel reads
# K whole (its Tiles have no K step and no splits), so it is never narrowed.
K_FLOOR = LANES


@dataclasses.dataclass(frozen=True)
class Tiles:
    """n: output columns a grid step writes (`tiles.lookup("linear_tpu", ..)`) of a [K, N] or [H, Dh, N]
    segment where n is a whole number of 128-lane blocks dividing N (else the segment is one block);
    a segment of heads takes the most whole heads within n columns that Mosaic can block, else the
    fewest."""

    n: int


def shape_refusal(k: int, n: int, gated: bool, tiles: Tiles) -> str | None:
    """Why a product of K rows and N columns is not this kernel's (the catalog's shape check): a gated
    one (a dense MLP's gate|up, the shared experts'), whose activation is not here. Any other width
    compiles for a v5e (Qwen3-30B-A3B's; D 64 and 200, heads of 16 and 72, rotated halves of 8 and 24)."""
    if gated:
        return "no gated activation in the TPU dense kernel (a dense MLP and shared experts are XLA's)"
    return None


def _head_block(heads: int, head_dim: int, n: int) -> int:
    """Heads a step of a [K, H, Dh] segment reads: a block's second-minor dim is a multiple of 8 or
    all H (Mosaic's sublane tiles); the most such heads within n columns, else the fewest."""
    legal = [b for b in range(1, heads + 1) if heads % b == 0 and (b % 8 == 0 or b == heads)]
    fits = [b for b in legal if b * head_dim <= n]
    return max(fits) if fits else min(legal)


def _columns(n: int, tile: int) -> int:
    return tile if n % tile == 0 and tile % LANES == 0 else n


def _pick(stack: jax.Array, layer) -> jax.Array:
    """Row `layer` of a [L, N] stack value, by a sum with zeros (exact): [1, N]."""
    rows = lax.broadcasted_iota(jnp.int32, stack.shape, 0)
    return jnp.sum(jnp.where(rows == layer, stack, 0), axis=0, keepdims=True).astype(stack.dtype)


def _kernel(*refs, n_layers, tree, n_in, segs, at, eps, precision, normed):
    """Step p: a column block of whichever segment it falls in. layers: each stacked operand's
    layer ([1] int32 each) (`at`: where the norm's, and each segment's bias's and head norm's, lies in it).
    Refs: x [M, K] (or [M, H, Dh]), norm [L, K]; per segment its weight block ([K, c], [K, hb, Dh] or [H, Dh, c]),
    bias block [L, c], head norm [L, Dh]; cos, sin [M, R/2]; residual block [M, c]; then the
    outputs (`normed`: h [M, K] first), per segment its block [M, c] (heads: [M, hb, Dh]; an
    interleaved pair's one [M, 2H, Dh]); scratch: h, x's shape."""
    layers, refs = [r[0] for r in refs[:n_layers]], refs[n_layers:]
    ins = jax.tree.unflatten(tree, refs[:n_in])
    *outs, h_ref = refs[n_in:]
    normed_ref, outs = (outs[0], outs[1:]) if normed else (None, outs)
    p = pl.program_id(0)
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)

    @pl.when(p == 0)
    def _():  # the rows' RMSNorm (transformers': statistics in f32, the weight in x's dtype), once
        x = ins["x"][...]
        if ins["norm"] is None:
            h_ref[...] = x.astype(h_ref.dtype)
            return
        xf = x.astype(jnp.float32)
        rstd = lax.rsqrt(jnp.mean(xf * xf, axis=1, keepdims=True) + eps)
        h = normalize(xf, rstd, _pick(ins["norm"][...], layers[at["norm"]]), x.dtype)
        h_ref[...] = h.astype(h_ref.dtype)
        if normed:
            normed_ref[...] = h.astype(normed_ref.dtype)

    def step(seg, refs, where, out_ref):
        h = h_ref[...].astype(seg["cdtype"])
        bias = None if refs["bias"] is None else _pick(refs["bias"][...], layers[where["bias"]])
        if seg["form"] != "heads":
            w = refs["w"][...].astype(seg["cdtype"])
            if len(h_ref.shape) == 3:  # rows of heads [M, H, Dh] times [H, Dh, c]: a product a head, f32 sums
                acc = sum(dot(h_ref[:, j, :].astype(seg["cdtype"]), w[j]) for j in range(h_ref.shape[1]))
            else:  # [H, Dh, c] -> [K, c]: its leading dims, Dh whole sublane tiles
                acc = dot(h, w.reshape(-1, w.shape[-1]))
            y = epilogue.finish(acc, seg["out_dtype"], bias=bias)
            if ins["residual"] is not None:
                y = (ins["residual"][...] + y).astype(seg["out_dtype"])
            out_ref[...] = y.astype(out_ref.dtype)
            return
        dh, half = seg["head_dim"], seg["half"]
        hn = None if refs["head_norm"] is None else _pick(refs["head_norm"][...], layers[where["head_norm"]])
        for j in range(refs["w"].shape[1]):  # each head of the block: its own product and epilogue
            cols = slice(j * dh, (j + 1) * dh)
            acc = dot(h, refs["w"][:, j, :].astype(seg["cdtype"]))  # [M, Dh] f32
            y = epilogue.finish(acc, seg["out_dtype"], bias=None if bias is None else bias[:, cols])
            if hn is not None:
                yf = y.astype(jnp.float32)
                y = normalize(yf, lax.rsqrt(jnp.mean(yf * yf, axis=1, keepdims=True) + eps), hn, y.dtype)
            if seg["rotate"]:
                cos, sin = (a[...] for a in ins["rope"])
                yf = y.astype(jnp.float32)
                y1, y2 = rotate_half(yf[:, :half], yf[:, half : 2 * half], cos, sin)
                rest = [yf[:, 2 * half :]] if 2 * half < dh else []  # the unrotated columns
                y = jnp.concatenate([y1, y2, *rest], axis=1).astype(seg["out_dtype"])
            row = j if seg["pair"] is None else 2 * j + seg["pair"]  # interleaved: k's head j at 2j, v's at 2j + 1
            out_ref[:, row, :] = y.astype(out_ref.dtype)

    for seg, refs, where in zip(segs, ins["segments"], at["segments"]):
        pl.when((p >= seg["first"]) & (p < seg["first"] + seg["count"]))(
            functools.partial(step, seg, refs, where, outs[seg["out"]])
        )


def _form(shape: tuple, k: int) -> str:
    """How a segment's weight (its layer's shape) meets K: "columns" [K, N], "heads" [K, H, Dh] or
    "rows" [H, Dh, N] (K = H * Dh)."""
    if len(shape) == 2 and shape[0] == k:
        return "columns"
    if len(shape) == 3 and shape[0] == k:
        return "heads"
    if len(shape) == 3 and shape[0] * shape[1] == k:
        return "rows"
    raise ValueError(f"fused_linear: a weight segment must be [K={k}, N], [K, H, Dh] or [H, Dh, N], got {shape}")


def _abstract(a, flat: bool = False):
    """An operand's layer (an array or LayerOf; `flat`: a vector) as a shape and dtype, for the checks."""
    if a is None:
        return None
    return jax.ShapeDtypeStruct((math.prod(a.shape),) if flat else tuple(a.shape), layered.stored(a).dtype)


def fused_linear(
    x: jax.Array,
    weights: tuple,
    *,
    norm=None,
    eps: float = 1e-6,
    biases: tuple | None = None,
    residual: jax.Array | None = None,
    head_dim: int | None = None,
    head_norms: tuple | None = None,
    rope: tuple[jax.Array, jax.Array] | None = None,
    rotate: tuple[bool, ...] | None = None,
    act=None,
    out_dtype=None,
    normed: bool = False,
    interleave: bool = False,
    precision: str | None = None,
    tiles: Tiles,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """`linear.fused_linear`'s contract on a TPU: rows x [M, K] (M <= 128: one block) times each
    weight segment -> one output per segment [M, N_i] (with `normed`, the normed rows [M, K] first).
    A segment is [K, N_i], or in its model's shape [K, H, Dh] (N_i = H * Dh; a segment with a head
    epilogue is one), whose output is [M, H, Dh], or [H, Dh, N_i] (K = H * Dh), which also takes
    rows of heads x [M, H, Dh] (the layouts attention writes and reads: a TPU's reshape of [M, K]
    to [M, H, Dh] or back is a copy, their last two dims its tiled ones); `interleave`: the last two
    segments, heads of one shape (attention's k and v), as one output [M, 2H, Dh], their heads
    alternating (k0 v0 k1 v1 ..: the rows of the interleaved page pool), each read in one step;
    each weight, the norm [K], the
    biases [N_i] and the head norms [head_dim] an array or a `layered.LayerOf` of its run's stack,
    read where it lies. The epilogue's arguments are `linear.fused_linear`'s; act is refused (a
    gated product is XLA's here). precision: None or "highest" (float32 products). tiles: the
    column block. interpret: Pallas' interpreter."""
    if precision not in PRECISIONS:
        raise ValueError(f"fused_linear: precision must be one of {PRECISIONS}, got {precision!r}")
    if act is not None:
        raise ValueError("fused_linear: the TPU dense kernel has no gated activation (XLA's ops run it)")
    if tiles.n < 1:
        raise ValueError(f"fused_linear: tiles.n must be positive, got {tiles.n}")
    if x.ndim not in (2, 3) or x.shape[0] > 128:
        raise ValueError(f"fused_linear: rows must be [M <= 128, K] or [M, H, Dh], got shape {x.shape}")
    check_normed(normed, norm)
    uniform_heads("fused_linear (TPU)", head_dim)
    m, k = x.shape[0], math.prod(x.shape[1:])
    count = len(weights)
    shapes = [tuple(w.shape) for w in weights]
    forms = [_form(s, k) for s in shapes]
    if x.ndim == 3 and (norm is not None or any(f != "rows" or s[:2] != x.shape[1:] for f, s in zip(forms, shapes))):
        raise ValueError(
            f"fused_linear: rows of heads {x.shape} take no norm and weights [H, Dh, N] of their heads, got {shapes}"
        )
    if interleave and (count < 2 or forms[-2:] != ["heads", "heads"] or shapes[-2] != shapes[-1]):
        raise ValueError(f"fused_linear: interleave takes two last segments of heads of one shape, got {shapes}")
    biases, head_norms = biases or (None,) * count, head_norms or (None,) * count
    # The arguments checked, and the segments' output dtypes, as the GPU twins lay them out.
    as_columns = lambda w, s, f: jax.ShapeDtypeStruct(  # noqa: E731
        (k, s[1] * s[2] if f == "heads" else s[-1]), layered.stored(w).dtype
    )
    laid_out = segments(
        jax.ShapeDtypeStruct((m, k), x.dtype),
        tuple(as_columns(w, s, f) for w, s, f in zip(weights, shapes, forms)),
        norm=_abstract(norm),
        biases=tuple(_abstract(b, flat=True) for b in biases),  # [N], or a head segment's [H, Dh]
        residual=residual,
        head_dim=head_dim,
        head_norms=tuple(map(_abstract, head_norms)),
        rope=rope,
        rotate=rotate,
        act=None,
        out_dtype=out_dtype,
        tn=None,
    )
    for s, f, seg in zip(shapes, forms, laid_out):
        if (seg.head_norm or seg.rotate) and f != "heads" or f == "heads" and head_dim not in (None, s[2]):
            raise ValueError(
                f"fused_linear: a head epilogue takes a segment of heads [K, H, head_dim={head_dim}], got {f} {s}"
            )

    # Every stacked operand's layer, a scalar-prefetched [1] int32 each; its BlockSpec's map reads its own.
    layers = []

    def stacked(a, block, index, rows=False):  # (a's stack, its BlockSpec) and its layer's entry; rows: [L, N]
        stack, layer = layered.stacked(a)
        stack = stack.reshape(stack.shape[0], -1) if rows else stack
        layers.append(layer)
        s = len(layers) - 1
        spec = pl.BlockSpec(memory_space=pltpu.VMEM) if block is None else pl.BlockSpec(block, index(s))
        return (stack, spec), s

    whole = pl.BlockSpec(memory_space=pltpu.VMEM)  # the array whole, in VMEM for the call
    pairs = {"x": (x, whole), "norm": None, "segments": [], "rope": None, "residual": None}
    at = {"norm": None, "segments": []}
    if norm is not None:
        pairs["norm"], at["norm"] = stacked(norm, None, None)
    segs, first = [], 0
    for i, (w, b, hn, s, f, seg) in enumerate(zip(weights, biases, head_norms, shapes, forms, laid_out)):
        pair = i - (count - 2) if interleave and i >= count - 2 else None  # 0: k, 1: v, of one output
        if f == "heads":
            hb = s[1] if pair is not None else _head_block(s[1], s[2], tiles.n)
            blocks, cols = s[1] // hb, hb * s[2]
        else:
            cols = _columns(s[-1], tiles.n)
            blocks = s[-1] // cols

        def block(i, first=first, blocks=blocks):  # the segment's block at step i, held past its steps
            return jnp.clip(i - first, 0, blocks - 1)

        if f == "columns":
            w_pair, _ = stacked(w, (None, k, cols), lambda s_, block=block: lambda i, *ls: (ls[s_][0], 0, block(i)))
        elif f == "heads":
            w_pair, _ = stacked(
                w, (None, k, hb, s[2]), lambda s_, block=block: lambda i, *ls: (ls[s_][0], 0, block(i), 0)
            )
        else:
            w_pair, _ = stacked(
                w, (None, s[0], s[1], cols), lambda s_, block=block: lambda i, *ls: (ls[s_][0], 0, 0, block(i))
            )
        refs, where = {"w": w_pair, "bias": None, "head_norm": None}, {"bias": None, "head_norm": None}
        if b is not None:  # [L, N]: every layer's columns of the block (a row of a stack is no sublane tile)
            layers_b = layered.stacked(b)[0].shape[0]
            refs["bias"], where["bias"] = stacked(
                b, (layers_b, cols), lambda s_, block=block: lambda i, *ls: (0, block(i)), rows=True
            )
        if hn is not None:
            refs["head_norm"], where["head_norm"] = stacked(hn, None, None)
        pairs["segments"].append(refs)
        at["segments"].append(where)
        half = 0 if rope is None else rope[0].shape[1]
        segs.append(dict(form=f, first=first, count=blocks, cols=cols, head_dim=head_dim, half=half,
                         rotate=seg.rotate, cdtype=seg.cdtype, out_dtype=seg.out_dtype, shape=s,
                         pair=pair, out=min(i, count - 2) if interleave else i))  # fmt: skip
        first += blocks
    if rope is not None:
        pairs["rope"] = tuple((a.astype(jnp.float32), whole) for a in rope)
    if residual is not None:
        cols = segs[0]["cols"]
        pairs["residual"] = (residual, pl.BlockSpec((m, cols), lambda i, *ls: (0, jnp.clip(i, 0, first - 1))))
    is_pair = lambda a: isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], pl.BlockSpec)  # noqa: E731
    flat = jax.tree.leaves(pairs, is_leaf=is_pair)
    operands, in_specs = [a for a, _ in flat], [spec for _, spec in flat]
    tree = jax.tree.structure(jax.tree.map(lambda _: 0, pairs, is_leaf=is_pair))

    h_dtype = x.dtype if norm is None else jnp.result_type(layered.stored(norm).dtype, x.dtype)

    def out(sg, seg):  # (a segment's output, its BlockSpec): heads [M, H, Dh] in blocks of heads, else [M, N]
        block = lambda i: jnp.clip(i - sg["first"], 0, sg["count"] - 1)  # noqa: E731
        if sg["pair"] is not None:  # the pair's [M, 2H, Dh], whole for the call
            _, heads, dh = sg["shape"]
            return metadata.varying_struct((m, 2 * heads, dh), seg.out_dtype, x, *operands), pl.BlockSpec(
                (m, 2 * heads, dh), lambda i, *ls: (0, 0, 0)
            )
        if sg["form"] == "heads":
            _, heads, dh = sg["shape"]
            spec = pl.BlockSpec((m, sg["cols"] // dh, dh), lambda i, *ls: (0, block(i), 0))
            return metadata.varying_struct((m, heads, dh), seg.out_dtype, x, *operands), spec
        return metadata.varying_struct((m, seg.n), seg.out_dtype, x, *operands), pl.BlockSpec(
            (m, sg["cols"]), lambda i, *ls: (0, block(i))
        )

    kept = [(sg, seg) for sg, seg in zip(segs, laid_out) if sg["pair"] != 1]  # an interleaved pair's output once
    out_shape, out_specs = (list(a) for a in zip(*(out(sg, seg) for sg, seg in kept)))
    if normed:
        out_shape.insert(0, metadata.varying_struct((m, k), h_dtype, x, *operands))
        out_specs.insert(0, pl.BlockSpec((m, k), lambda i, *ls: (0, 0)))
    kernel = functools.partial(
        _kernel,
        n_layers=len(layers),
        tree=tree,
        n_in=len(operands),
        segs=segs,
        at=at,
        eps=eps,
        precision=precision,
        normed=normed,
    )

    # VMEM: each blocked operand's and output's block twice over (the pipeline fetches the next step's
    # during this one), the whole ones once, the normed rows; and room for a step's temporaries.
    def resident(shape, spec, dtype):  # a block's bytes in VMEM's tiles (sublanes of 32 bits, 128 lanes)
        dims = list(shape if spec.block_shape is None else (b or 1 for b in spec.block_shape))
        itemsize = jnp.dtype(dtype).itemsize
        if len(dims) >= 2:
            dims[-2] = -(-dims[-2] // (32 // itemsize)) * (32 // itemsize)
        dims[-1] = -(-dims[-1] // LANES) * LANES
        return (1 if spec.block_shape is None else 2) * math.prod(dims) * itemsize

    vmem = sum(resident(a.shape, spec, a.dtype) for a, spec in zip(operands, in_specs))
    vmem += sum(resident(o.shape, spec, o.dtype) for o, spec in zip(out_shape, out_specs))
    vmem += m * k * 4 + 8 * m * max(seg.n for seg in laid_out) * 4 + (4 << 20)
    weight_bytes = sum(math.prod(s) * layered.stored(w).dtype.itemsize for w, s in zip(weights, shapes))
    results = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(layers),
            in_specs=in_specs,
            out_specs=tuple(out_specs),
            grid=(first,),
            scratch_shapes=[pltpu.VMEM(x.shape, h_dtype)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=max(vmem, 16 << 20)),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=2 * m * k * sum(seg.n for seg in laid_out),
            transcendentals=0,
            bytes_accessed=weight_bytes + 2 * x.size * x.dtype.itemsize,
        ),
    )(*layers, *operands)
    return tuple(results)
