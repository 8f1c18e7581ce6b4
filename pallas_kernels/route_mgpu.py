"""A Hopper (sm_90) decode step's router as a Mosaic GPU kernel: the MoE's RMSNorm, the router's
float32 logits, each row's top-k picks and their weights (`route_tpu`'s contract; XLA's router was
seven launches a layer and a [D, E] float32 temporary of the weight's shape).

float32 products, on CUDA cores. wgmma would take the float32 weight as TF32 (10 mantissa bits,
~1e-3 off: an H200's logits were 1.1e-3 off transformers'), and a split-TF32 scheme (hi*hi + hi*lo
+ lo*hi) has no operand layout here: TF32 wgmma wants both operands K-major, and the router weight
[D, E] is E-major (a transposed copy would be the weight-shaped temporary this kernel removes).
So a program's logits [64 rows, E] are a sum of outer products, one per K row d: the normed rows'
column d (a [64] vector, read down a shared-memory tile of them) times the weight's row d ([E]),
float32 FMAs, each product exact in f32's rounding as XLA's HIGHEST one is.

Program (s, c, r): K slice s of row tile r (64 rows: a warpgroup's register tile), its experts'
chunk c (`Tiles.e` columns of the logits). A first pipeline over x sums each row's squares (every
program: x is a decode step's few rows); the main one streams the slice's x [64, tk] and weight
[tk, e] f32 tiles with TMA, norms the rows as the model rounds them (bf16), writes them to the normed
output h (the experts multiply it; the slice's first chunk's program) and into a shared f32 tile
whose columns the outer products read. With one slice (`Tiles.splits`) and one chunk the program
then scores, picks (`topk`) and weighs its rows; with more (a decode step of a few rows fills the
SMs only so: chunks first, which add no partials to sum) each writes its f32 partial logits [M, e]
and a second launch of this kernel (`combine`) sums a row tile's slices and picks: two launches, as
`linear_mgpu`'s split K.

Shapes (`shape_refusal`, the catalog's check): D whole 64-column swizzled tiles; E a multiple of 8
(a register tile's columns) up to 256 (a TMA box). ids and weights are k' = k rounded up to 8
columns wide in the kernel (sliced after). DeepSeek's group stage and a routing override are not
here: `moejax.model.projections.route` runs XLA's router for those.

Verified without a GPU (tests/test_route_mgpu.py): jax's Mosaic GPU interpreter against float64
numpy, and the lowering and XLA:GPU compile for a compile-only H100; not run on a GPU here, nor timed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import layered, metadata, mgpu_api, topk
from pallas_kernels.gmm_mosaic_gpu import InterpretGPUParams
from pallas_kernels.linear_segments import normalize
from pallas_kernels.mgpu_blocks import smem_transforms, store_rows
from pallas_kernels.tiles import round_up

NAME = "route_mgpu"  # its custom call's op_name ends ".../NAME/mpmd_map" (`moejax.compiled.hlo`)
ROWS = 64  # a program's rows: a warpgroup's register tile
NORM_COLS = 256  # the norm pre-pass's K step: TMA's widest box
MAX_EXPERTS = 256  # a TMA box's most elements along an axis: one box of a weight row
K_FLOOR = 64  # the least K step the fill rule narrows to (`registry.route`)
# The most bytes of a row's partial logits (slices x E f32) the fill rule splits D into: the combine's
# one program a row tile reads them within a launch gap at one SM's share of an H100's bandwidth.
PARTIAL_BYTES = 16384


def e_floor(e: int) -> int:
    """The least experts' chunk the fill rule narrows E to (`registry.route`): E halved while the
    half is whole register tiles' columns (8) and two 32-byte sectors of a weight row at least (16 f32)."""
    while e % 16 == 0 and e // 2 >= 16:
        e //= 2
    return e


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A call's tiles (`tiles.lookup("route_mgpu", ..)`): k K rows a pipeline step (a multiple of
    64), splits slices of K (a power of two), steps pipeline stages (at least 2), e experts' logits
    a program (a multiple of 8 dividing E; None: E whole)."""

    k: int
    splits: int
    steps: int
    e: int | None = None


def shape_refusal(k: int, n: int, gated: bool, tiles: Tiles) -> str | None:
    """Why a router of K = D rows and N = E experts is not this kernel's (`catalog`'s shape check)."""
    if k % 64:
        return f"D must be a multiple of 64 (128-byte swizzled tiles), got D={k}"
    if n % 8 or n > MAX_EXPERTS:
        return f"E must be a multiple of 8 up to {MAX_EXPERTS} (a register tile's columns, a TMA box), got E={n}"
    return None


def _check(x, norm, router, bias, k: int, scoring: str, tiles: Tiles):
    t, d = x.shape
    e = router.shape[1]
    topk.check(jax.ShapeDtypeStruct((t, e), jnp.float32), k, scoring, bias)
    if reason := shape_refusal(d, e, False, tiles):
        raise ValueError(f"route_mgpu: {reason}")
    if x.dtype != jnp.bfloat16 or norm.dtype != jnp.bfloat16 or router.dtype != jnp.float32:
        raise ValueError(
            f"route_mgpu: bf16 rows and norm, a float32 router; got {x.dtype}, {norm.dtype}, {router.dtype}"
        )
    if t > 2 * ROWS:
        raise ValueError(f"route_mgpu: at most {2 * ROWS} rows (a decode step's), got {t}")
    if tiles.k % 64 or d % (tiles.k * tiles.splits) or tiles.steps < 2 or tiles.splits & (tiles.splits - 1):
        raise ValueError(f"route_mgpu: tiles {tiles} are no whole K steps of D={d} in power-of-two slices")
    if tiles.e is not None and (tiles.e % 8 or e % tiles.e):
        raise ValueError(f"route_mgpu: tiles {tiles}: e must be a multiple of 8 dividing E={e}")


def _epilogue(logits, bias_ref, ids_ref, weights_ref, *, r, m, k, scoring, norm_topk_prob, scale, interpret):
    """logits [64, E] f32 of row tile r -> its rows of ids, weights [M, k'] (`route`'s scoring,
    picks and weights), stored."""
    wgmma = plgpu.Layout.WGMMA
    e, k_wide = logits.shape[1], ids_ref.shape[1]

    def spread(v, shape):  # a row reduction [64] across `shape`'s columns
        return lax.broadcast_in_dim(v, shape, (0,))

    def iota(shape):
        if interpret:
            return lax.broadcasted_iota(jnp.int32, shape, 1)
        return plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma)

    def softmax(x, mask=None):  # over the columns where mask: the rest weigh 0
        x = x if mask is None else jnp.where(mask, x, -jnp.inf)
        unnormalized = jnp.exp(x - spread(jnp.max(x, axis=1), x.shape))
        return unnormalized / spread(jnp.sum(unnormalized, axis=1), x.shape)

    bias = None
    if bias_ref is not None:  # [1, E] in GMEM, down every row
        row = bias_ref[0] if interpret else mgpu_api.load(bias_ref.at[0], wgmma.reduce(0), False)
        bias = lax.broadcast_in_dim(row, logits.shape, (1,))
    values, choice = topk.scores(logits, scoring, bias, softmax)
    experts, picks = iota((ROWS, e)), iota((ROWS, k_wide))
    in_k = None if k == k_wide else picks < k
    taken = jnp.zeros((ROWS, e), jnp.bool_)
    ids, weights = topk.pick(values, choice, k, experts, picks, taken, spread)
    weights = topk.weigh(
        weights,
        scoring,
        norm_topk_prob,
        scale,
        functools.partial(softmax, mask=in_k),
        lambda w: spread(jnp.sum(w if in_k is None else jnp.where(in_k, w, 0.0), axis=1), w.shape),
    )
    load, store = _access(interpret)
    store_rows(ids, ids_ref, r, m, load, store)
    store_rows(weights, weights_ref, r, m, load, store)


def _access(interpret: bool):
    """(load, store) of whole refs: `mgpu_api`'s, or plain reads and writes in the interpreter."""
    if interpret:
        return (lambda ref, *_: ref[...]), (lambda ref, value: ref.__setitem__(Ellipsis, value))
    return mgpu_api.load, mgpu_api.store_untiled


def _kernel(*refs, m, d, e, tk, splits, chunks, steps, eps, picking, interpret):
    """Program (s, c, r): K slice s of row tile r, experts' chunk c of `chunks` (e experts each).
    Refs (whole arrays in GMEM): x [M', D], norm [1, D], router [D, E] f32, bias [1, E] (where
    given); out: h [M, D], then ids, weights [M, k'] (one slice and chunk), or the partial logits
    [M', splits * E] f32 at columns s * E + c * e."""
    has_bias = picking["bias"]
    x_ref, norm_ref, router_ref, *refs = refs
    bias_ref = refs.pop(0) if has_bias else None
    h_ref, *outs = refs
    s, c, r = lax.axis_index("s"), lax.axis_index("c"), lax.axis_index("r")
    wgmma = plgpu.Layout.WGMMA
    cast = (lambda a, _: a) if interpret else plgpu.layout_cast
    load, store = _access(interpret)
    spread = lambda v, shape, dim: lax.broadcast_in_dim(v, shape, (dim,))  # noqa: E731
    per_split = d // tk // splits

    def square(_, x_smem, acc):
        xf = cast(x_smem[...], wgmma).astype(jnp.float32)
        return acc + jnp.sum(xf * xf, axis=1)

    cols = min(NORM_COLS, d)
    while d % cols:  # whole boxes of D
        cols //= 2
    spec = plgpu.BlockSpec((ROWS, cols), lambda i: (r, i), transforms=smem_transforms(cols, 16))
    zeros = cast(jnp.zeros((ROWS,), jnp.float32), wgmma.reduce(1))
    sumsq = plgpu.emit_pipeline(square, grid=(d // cols,), in_specs=[spec], max_concurrent_steps=2, init_carry=zeros)(
        x_ref
    )
    rstd = spread(lax.rsqrt(sumsq / d + eps), (ROWS, tk), 0)

    def step(h_smem, indices, x_smem, w_smem, norm_smem, acc):
        slot = lax.rem(indices[0], 2)  # the outer products of two steps ago read it, and are done
        xf = cast(x_smem[...], wgmma).astype(jnp.float32)
        nw = spread(load(norm_smem.at[0], wgmma.reduce(0)), (ROWS, tk), 1)
        h = normalize(xf, rstd, nw, jnp.bfloat16)  # as the model rounds the normed rows
        k0 = (s * per_split + indices[0]) * tk
        pl.when(c == 0)(lambda: store_rows(h, h_ref.at[:, pl.ds(k0, tk)], r, m, load, store))
        store(h_smem.at[slot], h.astype(jnp.float32))
        plgpu.commit_smem()  # every thread's columns visible to the warpgroup

        def outer(j, acc):  # acc + h[:, j] (x) w[j, :]
            column = h_smem[slot, :, j] if interpret else mgpu_api.load(h_smem.at[slot, :, j], wgmma.reduce(1), False)
            row = w_smem[j] if interpret else mgpu_api.load(w_smem.at[j], wgmma.reduce(0), False)
            return acc + spread(column, (ROWS, e), 0) * spread(row, (ROWS, e), 1)

        return lax.fori_loop(0, tk, outer, acc)

    specs = [
        plgpu.BlockSpec((ROWS, tk), lambda i: (r, s * per_split + i), transforms=smem_transforms(tk, 16)),
        plgpu.BlockSpec((tk, e), lambda i: (s * per_split + i, c)),
        plgpu.BlockSpec((1, tk), lambda i: (0, s * per_split + i)),
    ]

    def products(h_smem):
        first = cast(jnp.zeros((ROWS, e), jnp.float32), wgmma)
        return plgpu.emit_pipeline(
            lambda i, *refs: step(h_smem, i, *refs),
            grid=(per_split,),
            in_specs=specs,
            max_concurrent_steps=steps,
            init_carry=first,
        )(x_ref, router_ref, norm_ref)

    logits = pl.run_scoped(products, plgpu.SMEM((2, ROWS, tk), jnp.float32))
    if splits * chunks > 1:  # the slice's chunk of partial logits, summed by the combine launch
        store_rows(logits, outs[0].at[:, pl.ds(s * chunks * e + c * e, e)], r, m, load, store)
    else:
        _epilogue(logits, bias_ref, *outs, r=r, m=m, interpret=interpret, **_weighing(picking))


def _combine(parts_ref, *refs, m, e, splits, steps, picking, interpret):
    """Program r: row tile r's partial logits [M', splits * E] summed, then scored and picked."""
    bias_ref = refs[0] if picking["bias"] else None
    ids_ref, weights_ref = refs[-2:]
    r = lax.axis_index("r")
    wgmma = plgpu.Layout.WGMMA
    cast = (lambda a, _: a) if interpret else plgpu.layout_cast
    load, _ = _access(interpret)

    def add(_, part_smem, acc):  # an untiled f32 tile: no load plan free of bank conflicts, element-wise
        return acc + load(part_smem, wgmma, False)

    spec = plgpu.BlockSpec((ROWS, e), lambda j: (r, j))
    zeros = cast(jnp.zeros((ROWS, e), jnp.float32), wgmma)
    logits = plgpu.emit_pipeline(
        add, grid=(splits,), in_specs=[spec], max_concurrent_steps=min(steps, splits), init_carry=zeros
    )(parts_ref)
    _epilogue(logits, bias_ref, ids_ref, weights_ref, r=r, m=m, interpret=interpret, **_weighing(picking))


def _weighing(picking: dict) -> dict:
    return {key: v for key, v in picking.items() if key != "bias"}


def route_mgpu(
    x: jax.Array,
    norm: jax.Array,
    router: jax.Array,
    *,
    k: int,
    eps: float,
    scoring: str,
    bias: jax.Array | None = None,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    precision=None,
    slots: bool = False,
    tiles: Tiles,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, None]:
    """`route_tpu`'s router on Mosaic GPU: x [T, D] bf16 the residual stream's rows, norm [D] bf16,
    router [D, E] f32 (each an array or a `LayerOf` of its stack, sliced here), bias [E] (sigmoid:
    added to the scores to choose; topk_softmax: to the logits) -> (h [T, D] the normed rows,
    ids [T, k] int32, weights [T, k] f32, None: the set's experts kernel takes no slot table, so
    `slots` is moot), as `rms_norm` then `router.route` compute them. `precision` is moot too: the
    products are float32 FMAs. tiles: this module's `Tiles`; interpret: jax's Mosaic GPU interpreter."""
    del precision, slots
    norm, router = layered.resolved(norm), layered.resolved(router)
    _check(x, norm, router, bias, k, scoring, tiles)
    if interpret and InterpretGPUParams is None:
        raise ValueError(f"route_mgpu: this jax ({jax.__version__}) has no Mosaic GPU interpreter")
    m, d = x.shape
    e, k_wide = router.shape[1], round_up(k, 8)
    rows = m if m <= 8 else round_up(m, 8)  # a tiled TMA box's array: fewer rows than its 8-row tile, or whole tiles
    xp = jnp.pad(x, ((0, rows - m), (0, 0))) if rows > m else x
    picking = dict(
        bias=bias is not None,
        k=k,
        scoring=scoring,
        norm_topk_prob=norm_topk_prob,
        scale=routed_scaling_factor,
    )
    extra = [] if bias is None else [bias.reshape(1, e).astype(jnp.float32)]
    operands = [xp, norm.reshape(1, d), router, *extra]
    picked = [
        metadata.varying_struct((m, k_wide), jnp.int32, *operands),
        metadata.varying_struct((m, k_wide), jnp.float32, *operands),
    ]
    splits, chunk = tiles.splits, tiles.e or e
    chunks = e // chunk
    parts = [metadata.varying_struct((rows, splits * e), jnp.float32, *operands)]
    call = functools.partial(_launch, interpret=interpret)
    kernel = functools.partial(
        _kernel,
        m=m,
        d=d,
        e=chunk,
        tk=tiles.k,
        splits=splits,
        chunks=chunks,
        steps=tiles.steps,
        eps=eps,
        picking=picking,
        interpret=interpret,
    )
    h_type = metadata.varying_struct((m, d), x.dtype, *operands)
    two = splits * chunks > 1  # a second launch sums the partial logits and picks
    h, *outs = call(
        kernel, (splits, chunks, pl.cdiv(m, ROWS)), ("s", "c", "r"), [h_type, *(parts if two else picked)], operands
    )
    if two:
        combine = functools.partial(
            _combine, m=m, e=e, splits=splits, steps=tiles.steps, picking=picking, interpret=interpret
        )
        outs = call(combine, (pl.cdiv(m, ROWS),), ("r",), picked, [outs[0], *extra])
    ids, weights = outs if k == k_wide else (a[:, :k] for a in outs)
    return h, ids, weights, None


def _launch(kernel, grid, names, out_type, operands, *, interpret):
    """`kernel` called on `operands` as a Mosaic GPU call over `grid`, its grid as a named scope around
    the call (a compiled Mosaic GPU call holds its module as bytecode: what reads the program's grid
    reads it here)."""
    # TMA reads zeros past an array's end; the interpreter does where its out-of-bounds reads give zeroed memory.
    params = InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero") if interpret else None
    # Lane semantics: the kernel places its register arrays (as `linear_mgpu`).
    compiled = (
        {} if interpret else dict(compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))
    )
    with jax.named_scope("grid_" + "x".join(map(str, grid))):
        return plgpu.kernel(
            kernel, out_type=out_type, grid=grid, grid_names=names, kernel_name=NAME, interpret=params, **compiled
        )(*operands)
