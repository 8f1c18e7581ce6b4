"""GQA and MLA decode attention over a paged KV cache on Mosaic GPU (Hopper, Blackwell), flash-decoding in one launch.

q: [B, H, Dh], one decode position per request (its `lens - 1`), over the pools k, v
[pages, H_kv, page_size, W] (the XLA path's layout: a kv head's page is contiguous, its rows
`pool_width` wide, zeros after Dh), a block table [B, P] of page ids (an id outside
[0, pages), e.g. `pages`, names no page: its positions are masked) and lens [B] -> [B, H, Dh].
Sliding windows (keys older than `window` positions masked; `window` may be traced, 0: none) and
attention sinks (a per-head logit in the softmax's denominator that attends to nothing) as in
`moejax.model.attention._attend`.

One CTA (one warpgroup) per (split, request, kv head). A split's pages come a compute block of
`pages_per_block` pages at a time, double-buffered: TMA copies each page's [page_size, W] rows
(viewed as rows of the pool [pages * H_kv * page_size, W]) into a slot of rows in swizzled SMEM,
the next block's copies in flight while this one computes. Each of the G = H / H_kv query heads
of the kv head (read from SMEM for each block) computes its scores against the block's keys on
the CUDA cores (elementwise products summed over W, in f32: f32 pools keep full precision,
where a tensor core's TF32 would not), then the online softmax and its values' weighted sum
(in SMEM, one row per head). Decode reads every key once, so it is bound by memory, not flops.

The split combine is in the same launch: every split but the last writes its normalized output
and log-sum-exp per head to a GMEM scratch and signals the request's semaphore; the CTA of the
last split waits for the others' signals, then reads their partials a chunk of splits a copy and
merges them one at a time in a loop (the code is one merge at any number of splits), and writes
the combined output (sinks join there). CTAs are dispatched in grid order, each (request, kv head)'s last split after
its others, so the waiting CTA never waits on one that cannot start. With splits, XLA zero-fills
the semaphores first (a fusion of B * H_kv int32): two launches; one without.

MLA's absorbed decode attention (`latent_attention`) is the same flash decoding over MLA's pools:
the latent [pages, ps, C] (keys and values both) and the rope key [pages, ps, R], one of each per
position, shared by every query head. One CTA per (split, request, group of `heads` query heads)
copies a block's latent and rope rows once for its group (all H heads where SMEM holds their
[C] f32 sums beside the block: 16 of GLM-5.3's 64 at C = 512; the split's partials reuse the
blocks' SMEM after the last block), and scores each head as q . latent + q_rope . rope key, the
latent's columns a register tile at a time; its weighted sum is of the same latent rows in SMEM.
DSA's selection comes as a flag per position, laid out by XLA as the compute blocks hold their
rows (`_keep_rows`) and copied beside each block. Same split combine, no sinks, no windows.

The pools' and blocks' shapes, and what is padded or masked: `paged_layout_mgpu`.

Block sizes are arguments (`pages_per_block`, `splits`). `interpret=True` runs the kernel in
JAX's Mosaic GPU interpreter on any platform: there the register layouts are no-ops, and the
semaphores are left out (it has none: it runs the CTAs one at a time in grid order, which gives
the last split its partials already written).

Status: runs in the interpreter and compiles for an H100 (tests: XLA:GPU's compile lowers it to
PTX and assembles it with ptxas); not run on a GPU here (`tests/test_gpu.py` runs it there): the
semaphores' ordering of the partials (TMA stores, then a release signal; an acquire wait, then
TMA loads) is only exercised on one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_layout_mgpu import (
    GRANULE,
    ROWS,
    SMEM_BYTES,
    TILE_ROWS,
    latent_query_rows,
    latent_smem_bytes,
    page_rows,
    partials_chunk,
    pool_width,
    query_rows,
    smem_bytes,
)
from pallas_kernels.tiles import round_up

SWIZZLES = (128, 64, 32)
# The kernel's name: its custom call's op_name in a compiled program ends ".../NAME/mpmd_map",
# which tells it from other Mosaic GPU calls (`tests/target_compiles.py`).
NAME = "paged_attention_mgpu"
TINY = 1e-30  # a divisor's floor where a sum of weights may be 0 (no key)


def _interpret_params():
    try:  # jax 0.10.2 to 0.11 (the newest checked) keep the Mosaic GPU interpreter's parameters private
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:
        raise NotImplementedError(f"this jax ({jax.__version__}) has no Mosaic GPU interpreter") from e
    return InterpretGPUParams()


def _check(q, k, v, table, lens, sinks, pages_per_block: int, splits: int):
    b, h, dh = q.shape
    pages, hkv, ps, w = k.shape
    if v.shape != k.shape or not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q {q.dtype}, k {k.shape} {k.dtype} and v {v.shape} {v.dtype} must match")
    if h % hkv:
        raise ValueError(f"{h} query heads are not groups of the pools' {hkv} kv heads")
    if w != pool_width(w, k.dtype) or dh > w:
        raise ValueError(f"the pools' heads of {w} must be whole {GRANULE}-byte granules of at least q's {dh}")
    if table.ndim != 2 or table.shape[0] != b or lens.shape != (b,):
        raise ValueError(f"table [B, P] and lens [B] for B = {b}, got {table.shape} and {lens.shape}")
    if sinks is not None and sinks.shape != (h,):
        raise ValueError(f"sinks must be one logit per query head ({h}), got {sinks.shape}")
    if pages_per_block < 1 or splits < 1:
        raise ValueError(f"pages_per_block ({pages_per_block}) and splits ({splits}) must be at least 1")
    if pages * hkv * ps < page_rows(ps):
        raise ValueError(f"a pool of {pages * hkv * ps} rows holds no copy of {page_rows(ps)} rows")
    if (need := smem_bytes(h // hkv, w, ps, pages_per_block, splits, k.dtype)) > SMEM_BYTES:
        raise ValueError(
            f"{pages_per_block} pages per block in {splits} splits need {need} bytes of SMEM, over {SMEM_BYTES}"
        )


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    table: jax.Array,
    lens: jax.Array,
    *,
    scale: float,
    window: jax.Array | int = 0,
    sinks: jax.Array | None = None,
    pages_per_block: int,
    splits: int,
    interpret: bool = False,
) -> jax.Array:
    """q: [B, H, Dh] at each request's position lens - 1, over k, v: [pages, H_kv, ps, W],
    table: int32 [B, P], lens: int32 [B] (clipped to [0, P * ps]), window: int32 scalar
    (0: none), sinks: [H] logits or None -> [B, H, Dh] in q's dtype."""
    _check(q, k, v, table, lens, sinks, pages_per_block, splits)
    b, h, dh = q.shape
    pages, hkv, ps, w = k.shape
    g = h // hkv
    gq = query_rows(g, w, q.dtype)
    rows = page_rows(ps)
    block = round_up(pages_per_block * rows, ROWS)
    n = b * hkv
    # q as [B * H_kv, Gq, W]: a bitcast when G and Dh need no padding.
    qs = jnp.pad(q.reshape(n, g, dh), ((0, 0), (0, gq - g), (0, w - dh)))
    flat = lambda pool: pool.reshape(pages * hkv * ps, w)
    tiled = _tiled(w, k.dtype)
    combine = splits > 1

    operands = [qs, flat(k), flat(v), table.astype(jnp.int32), lens.astype(jnp.int32)]
    operands.append(jnp.asarray(window, jnp.int32).reshape(1))
    if sinks is not None:
        operands.append(sinks.astype(jnp.float32).reshape(hkv, g))
    out_type = [jax.ShapeDtypeStruct((n, gq, w), q.dtype)]
    chunk = partials_chunk(splits)
    if combine:  # the other splits' partials, in whole chunks (the last one's tail never written nor read)
        out_type.append(jax.ShapeDtypeStruct((n, round_up(splits - 1, chunk), 2, gq, w), jnp.float32))
    scratch = [
        plgpu.SMEM((2, block, w), k.dtype, transforms=tiled),  # k: two slots
        plgpu.SMEM((2, block, w), k.dtype, transforms=tiled),  # v
        plgpu.SMEM((gq, w), q.dtype),  # the queries, then the outputs
        plgpu.SMEM((gq, w), jnp.float32),  # the heads' weighted values
        plgpu.SMEM((chunk, 2, gq, w), jnp.float32),  # partials: this split's, then a chunk of the others'
        plgpu.Barrier(num_arrivals=2 * pages_per_block, num_barriers=2),  # a slot's copies
        plgpu.Barrier(num_barriers=2),  # q, partials
    ]
    kernel = functools.partial(
        _kernel,
        config=_Config(
            hkv=hkv,
            groups=g,
            page_size=ps,
            rows=rows,
            block=block,
            pages_per_block=pages_per_block,
            splits=splits,
            scale=scale,
            sinks=sinks is not None,
            interpret=interpret,
        ),
    )
    # The grid as a named scope around the call: a compiled Mosaic GPU call holds its module as
    # bytecode, and what reads the compiled program (its programs against the SMs) reads it here.
    with jax.named_scope(f"grid_{splits}x{n}"):
        outs = plgpu.kernel(
            kernel,
            out_type=out_type,
            scratch_types=scratch,
            grid=(splits, n),
            grid_names=("split", "seq"),
            kernel_name=NAME,
            interpret=_interpret_params() if interpret else None,
            # Lane semantics, jax 0.10.2's default (0.11 made Warpgroup the default): the kernel places its
            # register arrays itself, and Warpgroup's layout inference finds no layouts for some page sizes
            # (pages of 12 on an H100 at jax 0.11.2).
            compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        )(*operands)
    return outs[0][:, :g, :dh].reshape(b, h, dh)


def _check_latent(q, q_rope, latent, k_rope, table, lens, keep, heads, pages_per_block, splits):
    b, h, c = q.shape
    pages, ps, _ = latent.shape
    if q_rope.shape[:2] != (b, h) or latent.shape[2] != c or k_rope.shape[:2] != (pages, ps):
        raise ValueError(
            f"q {q.shape} and q_rope {q_rope.shape} must be [B, H, C] and [B, H, R] over a latent pool "
            f"{latent.shape} [pages, ps, C] and a rope pool {k_rope.shape} [pages, ps, R]"
        )
    if k_rope.shape[2] != q_rope.shape[2] or not q.dtype == q_rope.dtype == latent.dtype == k_rope.dtype:
        raise ValueError(f"q, q_rope, latent and k_rope must share R and a dtype, got {q_rope.shape}, {k_rope.shape}")
    for name, w in (("latent", c), ("rope key", q_rope.shape[2])):
        if w != pool_width(w, q.dtype):
            raise ValueError(f"the {name}'s width {w} must be whole {GRANULE}-byte granules")
    if table.ndim != 2 or table.shape[0] != b or lens.shape != (b,):
        raise ValueError(f"table [B, P] and lens [B] for B = {b}, got {table.shape} and {lens.shape}")
    if keep is not None and keep.shape != (b, table.shape[1] * ps):
        raise ValueError(f"keep must be a flag per request and position [{b}, {table.shape[1] * ps}], got {keep.shape}")
    if heads < 1 or h % heads:
        raise ValueError(f"{h} query heads are not groups of {heads}")
    if pages_per_block < 1 or splits < 1:
        raise ValueError(f"pages_per_block ({pages_per_block}) and splits ({splits}) must be at least 1")
    if pages * ps < page_rows(ps):
        raise ValueError(f"a pool of {pages * ps} rows holds no copy of {page_rows(ps)} rows")
    need = latent_smem_bytes(heads, c, q_rope.shape[2], ps, pages_per_block, splits, q.dtype)
    if need > SMEM_BYTES:
        raise ValueError(
            f"{heads} heads a CTA over {pages_per_block} pages per block in {splits} splits need "
            f"{need} bytes of SMEM, over {SMEM_BYTES}"
        )


def _tiled(width: int, dtype) -> tuple:
    """The transforms of an SMEM buffer of rows `width` wide: tiles of 8 rows, swizzled."""
    swizzle = next(s for s in SWIZZLES if width * jnp.dtype(dtype).itemsize % s == 0)
    return plgpu.TilingTransform((TILE_ROWS, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def _keep_rows(keep, table, pages: int, rows: int, pages_per_block: int, block: int) -> jax.Array:
    """keep: bool [B, P * ps] -> f32 [B, blocks, block]: the flags as the kernel's compute blocks
    hold their positions (page slot r // rows of block j at row r % rows; the pool's last page,
    read from rows before it, shifted as its copy is; 0 on rows of no position)."""
    b, n = table.shape
    ps = keep.shape[1] // n
    named = (table >= 0) & (table < pages)
    row = jnp.where(named, table, 0) * ps
    offset = row - jnp.minimum(row, pages * ps - rows)  # [B, P]: the page's position 0's row in its copy
    local = jnp.arange(rows) - offset[..., None]  # [B, P, rows]
    flags = jnp.take_along_axis(keep.reshape(b, n, ps), jnp.clip(local, 0, ps - 1), axis=2)
    flags = flags & (local >= 0) & (local < ps)
    blocks = -(-n // pages_per_block)
    flags = jnp.pad(flags, ((0, 0), (0, blocks * pages_per_block - n), (0, 0)))
    flags = flags.reshape(b, blocks, pages_per_block * rows)
    return jnp.pad(flags, ((0, 0), (0, 0), (0, block - pages_per_block * rows))).astype(jnp.float32)


def latent_attention(
    q: jax.Array,
    q_rope: jax.Array,
    latent: jax.Array,
    k_rope: jax.Array,
    table: jax.Array,
    lens: jax.Array,
    keep: jax.Array | None = None,
    *,
    scale: float,
    heads: int,
    pages_per_block: int,
    splits: int,
    interpret: bool = False,
) -> jax.Array:
    """MLA's absorbed decode attention: q: [B, H, C] (the query in the latent space) and q_rope:
    [B, H, R] at each request's position lens - 1, over the pools latent: [pages, ps, C] (keys and
    values both) and k_rope: [pages, ps, R] (one rope key per position, shared by every head),
    table: int32 [B, P], lens: int32 [B], keep: bool [B, P * ps] (DSA's selected positions; None:
    all) -> softmax(scale * (q . latent + q_rope . k_rope)) @ latent: [B, H, C] in q's dtype.

    A CTA reads its request's pages once for `heads` query heads (H: all of them)."""
    _check_latent(q, q_rope, latent, k_rope, table, lens, keep, heads, pages_per_block, splits)
    b, h, c = q.shape
    r = q_rope.shape[2]
    pages, ps, _ = latent.shape
    groups = h // heads
    gq = latent_query_rows(heads, (c, r), q.dtype)
    rows = page_rows(ps)
    block = round_up(pages_per_block * rows, ROWS)
    n = b * groups
    # A head's row of C as C / cols rows of the latent's tile columns: the registers' chunks, and a
    # TMA copy's box is at most 256 elements along each axis.
    cols = _tiled(c, q.dtype)[0].tiling[1]
    chunked = (gq * (c // cols), cols)
    # The queries as [B * groups, gq, .]: a bitcast when the heads need no padding.
    rows_of = lambda x: jnp.pad(x.reshape(n, heads, x.shape[2]), ((0, 0), (0, gq - heads), (0, 0)))
    table = table.astype(jnp.int32)
    operands = [rows_of(q).reshape(n, *chunked), rows_of(q_rope), latent.reshape(pages * ps, c)]
    operands.append(k_rope.reshape(pages * ps, r))
    operands.append(table)
    operands.append(lens.astype(jnp.int32))
    if keep is not None:
        operands.append(_keep_rows(keep, table, pages, rows, pages_per_block, block))
    out_type = [jax.ShapeDtypeStruct((n, *chunked), q.dtype)]
    chunk = partials_chunk(splits, 2 * gq * c * 4)
    if splits > 1:  # the other splits' partials, in whole chunks (the last one's tail never written nor read)
        out_type.append(jax.ShapeDtypeStruct((n, round_up(splits - 1, chunk), 2, *chunked), jnp.float32))
    slots = (
        plgpu.SMEM((2, block, c), q.dtype, transforms=_tiled(c, q.dtype)),  # the latent: two slots
        plgpu.SMEM((2, block, r), q.dtype, transforms=_tiled(r, q.dtype)),  # the rope keys
        *([plgpu.SMEM((2, block), jnp.float32)] if keep is not None else []),  # the kept flags
    )
    # The blocks' slots, read until the last block's sums, then the partials (this split's, then a
    # chunk of the others'), written after: one SMEM for both (a head's partial is as wide as its
    # sum, 2 KB at C = 512; SMEM would hold half the heads with both). The interpreter has no unions.
    partials = plgpu.SMEM((chunk, 2, *chunked), jnp.float32)
    scratch = [
        (slots, partials) if interpret else plgpu.RefUnion(slots, partials),
        plgpu.SMEM(chunked, q.dtype),  # the queries, then the outputs
        plgpu.SMEM((gq, r), q.dtype),
        plgpu.SMEM(chunked, jnp.float32),  # the heads' weighted latents
        plgpu.SMEM((2, heads), jnp.float32),  # the heads' running max and total
        plgpu.Barrier(num_arrivals=2 * pages_per_block + (keep is not None), num_barriers=2),  # a slot's copies
        plgpu.Barrier(num_arrivals=2),  # the queries
        plgpu.Barrier(),  # partials
    ]
    config = _Config(
        hkv=groups,
        groups=heads,
        page_size=ps,
        rows=rows,
        block=block,
        pages_per_block=pages_per_block,
        splits=splits,
        scale=scale,
        sinks=False,
        interpret=interpret,
        pool_heads=1,
        keeps=keep is not None,
    )
    with jax.named_scope(f"grid_{splits}x{n}"):
        outs = plgpu.kernel(
            functools.partial(_latent_kernel, config=config),
            out_type=out_type,
            scratch_types=scratch,
            grid=(splits, n),
            grid_names=("split", "seq"),
            kernel_name=NAME,
            interpret=_interpret_params() if interpret else None,
            compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        )(*operands)
    return outs[0].reshape(n, gq, c)[:, :heads].reshape(b, h, c)


@dataclasses.dataclass(frozen=True)
class _Config:
    """The kernel's static shape and choices."""

    hkv: int  # CTAs per request along "seq": GQA's kv heads, MLA's groups of query heads
    groups: int  # query heads per CTA
    page_size: int
    rows: int  # a page's copy (`page_rows`)
    block: int  # a compute block's rows
    pages_per_block: int
    splits: int
    scale: float
    sinks: bool
    interpret: bool
    pool_heads: int = 0  # heads a pool's page holds (0: hkv; MLA's latent: 1)
    keeps: bool = False  # MLA: a flag per position kept (DSA's selection)

    def cast(self, x, layout):
        """x in `layout` (registers; the interpreter has none)."""
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def iota(self, n: int, layout):
        """int32 0 .. n - 1 in `layout`."""
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, (n,), 0)
        return plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=layout)


ROW, COL = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)  # a [rows] and a [W] of a [rows, W] tile


@dataclasses.dataclass(frozen=True)
class _Span:
    """A CTA's request's visible positions [lo, length), the pages holding them [first, end) and
    its split's compute blocks [start, stop) of them, read through the block table."""

    c: _Config
    table_ref: object
    req: jax.Array
    pool_head: jax.Array  # the head of a pool page this CTA reads
    pool_rows: int  # the pool's rows (`pages * pool_heads * page_size`)
    lo: jax.Array
    length: jax.Array
    first: jax.Array
    end: jax.Array
    start: jax.Array
    stop: jax.Array

    @classmethod
    def of(cls, c: _Config, table_ref, lens_ref, pool_rows: int, req, pool_head, window, split):
        n_pages = table_ref.shape[1]
        length = jnp.clip(lens_ref[req], 0, n_pages * c.page_size)
        lo = jnp.where(window > 0, jnp.maximum(length - window, 0), 0)  # the first visible position
        first, end = lo // c.page_size, pl.cdiv(length, c.page_size)  # the pages holding [lo, length)
        blocks = pl.cdiv(end - first, c.pages_per_block)
        per_split = pl.cdiv(blocks, c.splits)
        start = jnp.minimum(split * per_split, blocks)
        stop = jnp.minimum(start + per_split, blocks)
        return cls(c, table_ref, req, pool_head, pool_rows, lo, length, first, end, start, stop)

    def page(self, j, i):
        """(the first pool row the copy of block j's page i reads, the row its position 0 lands
        on in the slot: >= rows where the table names no page there)."""
        c = self.c
        heads = c.pool_heads or c.hkv
        idx = self.first + j * c.pages_per_block + i
        pid = self.table_ref[self.req, jnp.minimum(idx, self.table_ref.shape[1] - 1)]
        named = (idx < self.end) & (pid >= 0) & (pid < self.pool_rows // (heads * c.page_size))
        row = (jnp.where(named, pid, 0) * heads + self.pool_head) * c.page_size
        read = jnp.minimum(row, self.pool_rows - c.rows)  # the pool's last page: read from rows before it
        return read, jnp.where(named, row - read, c.rows)

    def fetch(self, j, copies, barrier):
        """Block j's pages: each (pool, its slot's rows) of `copies` a copy per page onto `barrier`."""
        for i in range(self.c.pages_per_block):
            read, _ = self.page(j, i)
            for pool, smem in copies:
                plgpu.copy_gmem_to_smem(
                    pool.at[pl.ds(read, self.c.rows)], smem.at[pl.ds(i * self.c.rows, self.c.rows)], barrier
                )

    def visible(self, j):
        """bool [block] (ROW): which rows of block j hold a visible position. Row r of the block:
        page slot r // rows, its position (r % rows - offset of that slot)."""
        c = self.c
        r = c.iota(c.block, ROW)
        slot_of, offset = r // c.rows, jnp.full((c.block,), c.rows, jnp.int32)
        for i in range(c.pages_per_block):
            offset = jnp.where(slot_of == i, self.page(j, i)[1], offset)
        local = r % c.rows - offset
        pos = (self.first + j * c.pages_per_block + slot_of) * c.page_size + local
        return (local >= 0) & (local < c.page_size) & (pos >= self.lo) & (pos < self.length)


def _softmax_step(s, top, total):
    """The online softmax's step over a block's scores s [block] (ROW; -inf: invisible) ->
    (weights p, the factor the running sums keep, new top, new total)."""
    new_top = jnp.maximum(top, s.max())
    base = jnp.where(new_top == -jnp.inf, 0.0, new_top)  # no key seen yet
    p, kept = jnp.exp(s - base), jnp.exp(top - base)
    return p, kept, new_top, total * kept + p.sum()


def _kernel(*refs, config):
    c = config
    q_ref, k_ref, v_ref, table_ref, lens_ref, window_ref, *refs = refs
    sinks_ref = refs.pop(0) if c.sinks else None
    out_ref, *refs = refs
    part_ref = refs.pop(0) if c.splits > 1 else None
    k_smem, v_smem, qo_smem, acc_smem, part_smem, kv_barrier, barrier = refs

    split, seq = lax.axis_index("split"), lax.axis_index("seq")
    head = seq % c.hkv
    span = _Span.of(c, table_ref, lens_ref, k_ref.shape[0], seq // c.hkv, head, window_ref[0], split)
    width = qo_smem.shape[1]
    plgpu.copy_gmem_to_smem(q_ref.at[seq], qo_smem, barrier.at[0])
    fetch = lambda j, slot: span.fetch(j, ((k_ref, k_smem.at[slot]), (v_ref, v_smem.at[slot])), kv_barrier.at[slot])

    @pl.when(span.start < span.stop)
    def _():
        fetch(span.start, 0)

    plgpu.barrier_wait(barrier.at[0])
    for i in range(c.groups):
        acc_smem[i] = c.cast(jnp.zeros((width,), jnp.float32), COL)

    def step(j, carry):
        slot = (j - span.start) % 2

        @pl.when(j + 1 < span.stop)
        def _():
            fetch(j + 1, 1 - slot)

        visible = span.visible(j)
        plgpu.barrier_wait(kv_barrier.at[slot])
        keys = c.cast(k_smem[slot], plgpu.Layout.WGMMA).astype(jnp.float32)
        values = c.cast(v_smem[slot], plgpu.Layout.WGMMA).astype(jnp.float32)
        # Rows never written or another page's: zeros, so no NaN there reaches a weighted sum.
        values = jnp.where(lax.broadcast_in_dim(visible, values.shape, [0]), values, 0.0)
        out = []
        for i, (top, total) in enumerate(carry):
            # A head's query is read from SMEM at each use: G of them held in registers would spill.
            q_row = c.cast(qo_smem[i], COL).astype(jnp.float32)
            s = (keys * lax.broadcast_in_dim(q_row, keys.shape, [1])).sum(axis=1) * c.scale
            p, kept, new_top, new_total = _softmax_step(jnp.where(visible, s, -jnp.inf), top, total)
            # The head's row is read before the sum over the block's rows, whose exchange between
            # the warps orders every warp's read before any warp's write of it.
            acc = c.cast(acc_smem[i], COL) * kept
            acc_smem[i] = acc + (values * lax.broadcast_in_dim(p, values.shape, [0])).sum(axis=0)
            out.append((new_top, new_total))
        return tuple(out)

    init = tuple((jnp.float32(-jnp.inf), jnp.float32(0.0)) for _ in range(c.groups))
    stats = lax.fori_loop(span.start, span.stop, step, init)
    sink = (lambda i: sinks_ref[head, i]) if c.sinks else None
    _combine(c, stats, acc_smem, part_smem, part_ref, qo_smem, out_ref, barrier.at[1], seq, split, sink)


def _latent_kernel(*refs, config):
    """One CTA: a split of one request's pages for a group of its query heads (`latent_attention`)."""
    c = config
    q_ref, qr_ref, lat_ref, rope_ref, table_ref, lens_ref, *refs = refs
    keep_ref = refs.pop(0) if c.keeps else None
    out_ref, *refs = refs
    part_ref = refs.pop(0) if c.splits > 1 else None
    (slots, part_smem), qo_smem, qr_smem, acc_smem, stats_smem, kv_barrier, q_barrier, barrier = refs
    lat_smem, rope_smem, keep_smem = (*slots, None)[:3]

    split, seq = lax.axis_index("split"), lax.axis_index("seq")
    span = _Span.of(c, table_ref, lens_ref, lat_ref.shape[0], seq // c.hkv, 0, 0, split)
    plgpu.copy_gmem_to_smem(q_ref.at[seq], qo_smem, q_barrier)
    plgpu.copy_gmem_to_smem(qr_ref.at[seq], qr_smem, q_barrier)

    def fetch(j, slot):
        span.fetch(j, ((lat_ref, lat_smem.at[slot]), (rope_ref, rope_smem.at[slot])), kv_barrier.at[slot])
        if c.keeps:
            plgpu.copy_gmem_to_smem(keep_ref.at[span.req, j], keep_smem.at[slot], kv_barrier.at[slot])

    @pl.when(span.start < span.stop)
    def _():
        fetch(span.start, 0)

    # The latent's columns a register tile at a time (the swizzle's width): a [block, C] tile of
    # C = 512 would not fit in registers.
    # A head's latent row is n_chunks rows of the buffers [gq * n_chunks, cols].
    cols = acc_smem.shape[1]
    n_chunks = acc_smem.shape[0] // qr_smem.shape[0]
    plgpu.barrier_wait(q_barrier)
    for row in range(c.groups * n_chunks):
        acc_smem[row] = c.cast(jnp.zeros((cols,), jnp.float32), COL)
    for i in range(c.groups):
        stats_smem[0, i], stats_smem[1, i] = jnp.float32(-jnp.inf), jnp.float32(0.0)

    def dot(keys_ref, q_ref):
        """[block] (ROW): the rows of keys_ref [block, w] times q_ref [w] (SMEM views), in f32. Each
        load right before its layout cast: Mosaic GPU loads into the layout cast to next."""
        keys = c.cast(keys_ref[...], plgpu.Layout.WGMMA).astype(jnp.float32)
        q_row = c.cast(q_ref[...], COL).astype(jnp.float32)
        return (keys * lax.broadcast_in_dim(q_row, keys.shape, [1])).sum(axis=1)

    def step(j, carry):
        slot = (j - span.start) % 2

        @pl.when(j + 1 < span.stop)
        def _():
            fetch(j + 1, 1 - slot)

        visible = span.visible(j)
        plgpu.barrier_wait(kv_barrier.at[slot])
        if c.keeps:
            visible = visible & (c.cast(keep_smem[slot], ROW) > 0)

        def head(i, carry):
            """Head i's scores, softmax and weighted sum over the block; its running (max, total)
            in stats_smem: read before the sums over the block's rows, written after them."""
            top, total = stats_smem[0, i], stats_smem[1, i]
            s = dot(rope_smem.at[slot], qr_smem.at[i])
            for t in range(n_chunks):
                s = s + dot(lat_smem.at[slot, :, pl.ds(t * cols, cols)], qo_smem.at[i * n_chunks + t])
            p, kept, new_top, new_total = _softmax_step(jnp.where(visible, s * c.scale, -jnp.inf), top, total)
            # Rows never written or another page's weigh zeros, so no NaN there reaches the sum.
            p = lax.broadcast_in_dim(p, (c.block, cols), [0])
            rows = lax.broadcast_in_dim(visible, (c.block, cols), [0])
            for t in range(n_chunks):
                latent = c.cast(lat_smem[slot, :, pl.ds(t * cols, cols)], plgpu.Layout.WGMMA)
                values = jnp.where(rows, latent.astype(jnp.float32), 0.0)
                # Read before the sum over the block's rows, whose exchange orders the warps (`_kernel`).
                acc = c.cast(acc_smem[i * n_chunks + t], COL) * kept
                acc_smem[i * n_chunks + t] = acc + (values * p).sum(axis=0)
            stats_smem[0, i], stats_smem[1, i] = new_top, new_total
            return carry

        # A loop over the heads: unrolled, 16 heads' code took a minute to compile.
        lax.fori_loop(0, c.groups, head, 0)
        return carry

    lax.fori_loop(span.start, span.stop, step, 0)
    stats = [(stats_smem[0, i], stats_smem[1, i]) for i in range(c.groups)]
    # The partials overwrite the slots: every copy into them was waited for, and every warp's last
    # read of them came before the last sum's exchange between the warps.
    _combine(c, stats, acc_smem, part_smem, part_ref, qo_smem, out_ref, barrier, seq, split, head_rows=n_chunks)


def _combine(
    c: _Config, stats, acc_smem, part_smem, part_ref, out_smem, out_ref, barrier, seq, split, sink=None, head_rows=1
):
    """The split combine: this split's partial from its heads' (top, total) `stats` and weighted
    sums in acc_smem; every split but the last writes it to part_ref and signals, the last merges
    the others' (and each head's `sink(i)` logit, if any) and writes the output rows of `seq`.
    A head is `head_rows` rows of the buffers [rows, W] (GQA's: one; MLA's: its latent's chunks)."""
    # A request's semaphore counts its other splits' partials written (zeros at launch: XLA's memset).
    semaphores = None
    if c.splits > 1 and not c.interpret:
        semaphores = pl.get_global(plgpu.SemaphoreType.REGULAR((out_ref.shape[0],)))
    width = acc_smem.shape[-1]
    # This split's partial in part_smem[0]: per head its normalized output, and its log-sum-exp
    # across a row (0 and -inf where it saw no key). A head that saw no key has total 0 and its sum
    # 0: 0 / TINY. (Not a select on `total > 0`: Mosaic GPU's warpgroup lowering (jax 0.11 on) has
    # no select of a [W] by a scalar.)
    zeros = c.cast(jnp.zeros((width,), jnp.float32), COL)
    for i, (top, total) in enumerate(stats):
        lse = jnp.where(total > 0, top + jnp.log(jnp.maximum(total, TINY)), -jnp.inf)
        for row in range(i * head_rows, (i + 1) * head_rows):
            part_smem[0, 0, row] = c.cast(acc_smem[row], COL) / jnp.maximum(total, TINY)
            part_smem[0, 1, row] = zeros + lse
    plgpu.commit_smem()

    last = split == c.splits - 1
    if c.splits > 1:

        @pl.when(~last)
        def _():
            plgpu.copy_smem_to_gmem(part_smem.at[0], part_ref.at[seq, split])
            plgpu.wait_smem_to_gmem(0)
            if semaphores is not None:
                pl.semaphore_signal(semaphores.at[seq])

    def merge(s, running):
        """The running (max log-sum-exp, sum of the weights under it, weighted outputs' sum), each
        [gq, W] in registers, with the partial in part_smem[s]: elementwise, every head at once
        (padded heads' rows hold what SMEM held: apart, never written out)."""
        top, total, acc = running
        out, lse = part_smem[s, 0], part_smem[s, 1]
        new_top = jnp.maximum(top, lse)
        base = jnp.where(new_top == -jnp.inf, 0.0, new_top)  # nothing seen yet
        kept, weight = jnp.exp(top - base), jnp.exp(lse - base)
        return new_top, total * kept + weight, acc * kept + out * weight

    @pl.when(last)
    def _():
        running = merge(0, (-jnp.inf, 0.0, 0.0))  # this split's own
        if c.splits > 1:
            if semaphores is not None:
                pl.semaphore_wait(semaphores.at[seq], c.splits - 1)
            chunk = part_smem.shape[0]  # the other splits' partials come `chunk` a copy (SMEM holds no more)

            def merge_chunk(t, running):
                plgpu.commit_smem()  # every read of the last chunk done before the copy overwrites it
                plgpu.copy_gmem_to_smem(part_ref.at[seq, pl.ds(t * chunk, chunk)], part_smem, barrier)
                plgpu.barrier_wait(barrier)
                return lax.fori_loop(0, jnp.minimum(chunk, c.splits - 1 - t * chunk), merge, running)

            # A loop: the code is one merge at any number of splits (unrolled, 35 took 53 s to compile).
            running = lax.fori_loop(0, part_ref.shape[1] // chunk, merge_chunk, running)
        if sink is not None:  # each head's sink: a partial whose output is 0, its logit in the denominator
            plgpu.commit_smem()
            for i in range(c.groups):
                for row in range(i * head_rows, (i + 1) * head_rows):
                    part_smem[0, 0, row] = zeros
                    part_smem[0, 1, row] = zeros + sink(i)
            plgpu.commit_smem()
            running = merge(0, running)
        _, total, acc = running
        # No key and no sink: every weight 0, so the sum 0 (no select).
        out_smem[...] = (acc / jnp.maximum(total, TINY)).astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[seq])
        plgpu.wait_smem_to_gmem(0)
