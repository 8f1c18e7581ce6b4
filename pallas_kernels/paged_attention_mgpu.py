"""GQA decode attention over a paged KV cache on Mosaic GPU (Hopper), flash-decoding in one launch.

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
    swizzle = next(s for s in SWIZZLES if w * k.dtype.itemsize % s == 0)
    tiled = (plgpu.TilingTransform((TILE_ROWS, swizzle // k.dtype.itemsize)), plgpu.SwizzleTransform(swizzle))
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


@dataclasses.dataclass(frozen=True)
class _Config:
    """The kernel's static shape and choices."""

    hkv: int
    groups: int
    page_size: int
    rows: int  # a page's copy (`page_rows`)
    block: int  # a compute block's rows
    pages_per_block: int
    splits: int
    scale: float
    sinks: bool
    interpret: bool

    def cast(self, x, layout):
        """x in `layout` (registers; the interpreter has none)."""
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def iota(self, n: int, layout):
        """int32 0 .. n - 1 in `layout`."""
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, (n,), 0)
        return plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=layout)


ROW, COL = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)  # a [rows] and a [W] of a [rows, W] tile


def _kernel(*refs, config):
    c = config
    q_ref, k_ref, v_ref, table_ref, lens_ref, window_ref, *refs = refs
    sinks_ref = refs.pop(0) if c.sinks else None
    out_ref, *refs = refs
    part_ref = refs.pop(0) if c.splits > 1 else None
    k_smem, v_smem, qo_smem, acc_smem, part_smem, kv_barrier, barrier = refs

    split, seq = lax.axis_index("split"), lax.axis_index("seq")
    req, head = seq // c.hkv, seq % c.hkv
    n_pages, width = table_ref.shape[1], qo_smem.shape[1]
    total_rows = k_ref.shape[0]
    pool_pages = total_rows // (c.hkv * c.page_size)
    length = jnp.clip(lens_ref[req], 0, n_pages * c.page_size)
    window = window_ref[0]
    lo = jnp.where(window > 0, jnp.maximum(length - window, 0), 0)  # the first visible position
    first, end = lo // c.page_size, pl.cdiv(length, c.page_size)  # the pages holding [lo, length)
    blocks = pl.cdiv(end - first, c.pages_per_block)
    per_split = pl.cdiv(blocks, c.splits)
    start = jnp.minimum(split * per_split, blocks)
    stop = jnp.minimum(start + per_split, blocks)

    # A request's semaphore counts its other splits' partials written (zeros at launch: XLA's memset).
    semaphores = None
    if c.splits > 1 and not c.interpret:
        semaphores = pl.get_global(plgpu.SemaphoreType.REGULAR((out_ref.shape[0],)))
    plgpu.copy_gmem_to_smem(q_ref.at[seq], qo_smem, barrier.at[0])

    def page(j, i):
        """(the first pool row the copy of block j's page i reads, the row its position 0 lands
        on in the slot: >= rows where the table names no page there)."""
        idx = first + j * c.pages_per_block + i
        pid = table_ref[req, jnp.minimum(idx, n_pages - 1)]
        named = (idx < end) & (pid >= 0) & (pid < pool_pages)
        row = (jnp.where(named, pid, 0) * c.hkv + head) * c.page_size
        read = jnp.minimum(row, total_rows - c.rows)  # the pool's last page: read from rows before it
        return read, jnp.where(named, row - read, c.rows)

    def fetch(j, slot):
        for i in range(c.pages_per_block):
            read, _ = page(j, i)
            for pool, smem in ((k_ref, k_smem), (v_ref, v_smem)):
                plgpu.copy_gmem_to_smem(
                    pool.at[pl.ds(read, c.rows)], smem.at[slot, pl.ds(i * c.rows, c.rows)], kv_barrier.at[slot]
                )

    @pl.when(start < stop)
    def _():
        fetch(start, 0)

    plgpu.barrier_wait(barrier.at[0])
    for i in range(c.groups):
        acc_smem[i] = c.cast(jnp.zeros((width,), jnp.float32), COL)

    def step(j, carry):
        slot = (j - start) % 2

        @pl.when(j + 1 < stop)
        def _():
            fetch(j + 1, 1 - slot)

        # Row r of the block: page slot r // rows, its position (r % rows - offset of that slot).
        r = c.iota(c.block, ROW)
        slot_of, offset = r // c.rows, jnp.full((c.block,), c.rows, jnp.int32)
        for i in range(c.pages_per_block):
            offset = jnp.where(slot_of == i, page(j, i)[1], offset)
        local = r % c.rows - offset
        pos = (first + j * c.pages_per_block + slot_of) * c.page_size + local
        visible = (local >= 0) & (local < c.page_size) & (pos >= lo) & (pos < length)

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
            s = jnp.where(visible, s, -jnp.inf)
            new_top = jnp.maximum(top, s.max())
            base = jnp.where(new_top == -jnp.inf, 0.0, new_top)  # no key seen yet
            p, kept = jnp.exp(s - base), jnp.exp(top - base)
            # The head's row is read before the sum over the block's rows, whose exchange between
            # the warps orders every warp's read before any warp's write of it.
            acc = c.cast(acc_smem[i], COL) * kept
            acc_smem[i] = acc + (values * lax.broadcast_in_dim(p, values.shape, [0])).sum(axis=0)
            out.append((new_top, total * kept + p.sum()))
        return tuple(out)

    init = tuple((jnp.float32(-jnp.inf), jnp.float32(0.0)) for _ in range(c.groups))
    stats = lax.fori_loop(start, stop, step, init)
    # This split's partial in part_smem[0]: per head its normalized output, and its log-sum-exp
    # across a row (0 and -inf where it saw no key). A head that saw no key has total 0 and its sum
    # 0: 0 / TINY. (Not a select on `total > 0`: Mosaic GPU's warpgroup lowering (jax 0.11 on) has
    # no select of a [W] by a scalar.)
    zeros = c.cast(jnp.zeros((width,), jnp.float32), COL)
    for i, (top, total) in enumerate(stats):
        part_smem[0, 0, i] = c.cast(acc_smem[i], COL) / jnp.maximum(total, TINY)
        part_smem[0, 1, i] = zeros + jnp.where(total > 0, top + jnp.log(jnp.maximum(total, TINY)), -jnp.inf)
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
                plgpu.copy_gmem_to_smem(part_ref.at[seq, pl.ds(t * chunk, chunk)], part_smem, barrier.at[1])
                plgpu.barrier_wait(barrier.at[1])
                return lax.fori_loop(0, jnp.minimum(chunk, c.splits - 1 - t * chunk), merge, running)

            # A loop: the code is one merge at any number of splits (unrolled, 35 took 53 s to compile).
            running = lax.fori_loop(0, part_ref.shape[1] // chunk, merge_chunk, running)
        if c.sinks:  # each head's sink: a partial whose output is 0, its logit in the denominator
            plgpu.commit_smem()
            for i in range(c.groups):
                part_smem[0, 0, i] = zeros
                part_smem[0, 1, i] = zeros + sinks_ref[head, i]
            plgpu.commit_smem()
            running = merge(0, running)
        _, total, acc = running
        # No key and no sink: every weight 0, so the sum 0 (no select).
        qo_smem[...] = (acc / jnp.maximum(total, TINY)).astype(qo_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[seq])
        plgpu.wait_smem_to_gmem(0)
