"""Our Mosaic GPU paged decode attention (`pallas_kernels/paged_attention_mgpu.py`): in JAX's Mosaic
GPU interpreter it gives the XLA path's outputs (`_gqa_attend` over `paged.read` of the pages) at
odd page sizes and head widths, with sliding windows, sinks, partial last pages, empty table slots
and its splits combined; and it compiles for an H100 into one Mosaic GPU kernel.

What is not checked here: the kernel's PTX (Mosaic GPU compiles its module when a GPU loads it),
and the semaphores that order the splits' combine on a GPU (the interpreter has none: it runs
the CTAs one at a time, in grid order). `tests/test_gpu.py` runs the kernel on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import compile_only
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_only import lower, on_h100

from moejax.compiled import hlo
from moejax.model import attention, paged
from pallas_kernels import catalog
from pallas_kernels import paged_attention_mgpu as mgpu

SCALE = 0.3
PAGES = 10
# Page 10 names none. Request 0 reads the pool's last page (9; its last kv head is the pool's last
# rows), request 1's last slot and request 2's last three are empty (past their lengths).
TABLE = np.array([[5, 2, 7, 9], [1, 9, 0, 10], [3, 10, 10, 10]], np.int32)


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str
    page_size: int
    head_dim: int
    heads: int
    kv_heads: int
    pages_per_block: int
    splits: int
    sinks: bool

    @property
    def lens(self) -> np.ndarray:
        """Positions each request holds: partial last pages, and one of under a page."""
        ps = self.page_size
        return np.array([4 * ps - 1, 3 * ps - 2, ps - 3], np.int32)


CASES = {
    # gpt-oss's attention at odd sizes: sinks, 3 query heads per kv head, pages of 6 (copies of 8
    # rows: the pool's last page is read from 2 rows before it), heads of 24 f32, 3 splits.
    "sinks_odd_pages": Case("float32", 6, 24, 6, 2, 2, 3, True),
    # Heads of 80 in bf16 (no padding: 160-byte rows), one page of 16 per block, 2 splits.
    "bf16_heads_of_80": Case("bfloat16", 16, 80, 4, 2, 1, 2, False),
    # One split (no partials); heads of 12 in a pool padded to 16; 3 pages of 8 per block of 64 rows.
    "one_split": Case("float32", 8, 12, 2, 1, 3, 1, False),
    # More splits than the combining CTA holds partials of at a time: a page per split over tables
    # of every page (`WIDE`), 12 splits, whose partials come in two copies (splits 0-7, then 8-10).
    "splits_in_chunks": Case("float32", 4, 24, 4, 2, 1, 12, True),
}
WIDE = np.array([[3, 1, 4, 0, 9, 2, 6, 5, 8, 7], [7, 0, 2, 9, 4, 10, 1, 3, 5, 6], [5, 8, 10, 10, 2, 0, 1, 3, 4, 6]])


def inputs(case: Case, seed: int = 0):
    """q [B, H, Dh], pools k, v [PAGES, H_kv, ps, W] (zeros after Dh) and sinks [H] (or None)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    dtype, dh = jnp.dtype(case.dtype), case.head_dim
    w = mgpu.pool_width(dh, dtype)
    pool = lambda key: paged.widen(jax.random.normal(key, (PAGES, case.kv_heads, case.page_size, dh)), w).astype(dtype)
    q = jax.random.normal(keys[0], (len(TABLE), case.heads, dh)).astype(dtype)
    sinks = jax.random.normal(keys[3], (case.heads,)) if case.sinks else None
    return q, pool(keys[1]), pool(keys[2]), sinks


@functools.cache
def kernel(case: Case, interpret: bool = True):
    """The kernel of `case`, jitted: one compile for any window, table or lens."""
    return jax.jit(
        lambda q, k, v, table, lens, window, sinks: mgpu.paged_attention(
            q,
            k,
            v,
            table,
            lens,
            scale=SCALE,
            window=window,
            sinks=sinks,
            pages_per_block=case.pages_per_block,
            splits=case.splits,
            interpret=interpret,
        )
    )


def run(name: str, window: int = 0, table=TABLE, lens=None, interpret: bool = True):
    """The kernel's output, waited for: the interpreter's callbacks dispatch computations of
    their own, and one dispatched beside them can deadlock XLA:CPU's queue (seen once in pytest)."""
    case = CASES[name]
    q, k, v, sinks = jax.block_until_ready(inputs(case))
    lens = case.lens if lens is None else lens
    out = kernel(case, interpret)(q, k, v, jnp.asarray(table), jnp.asarray(lens), jnp.int32(window), sinks)
    return out.block_until_ready()


def xla_path(q, k, v, table, lens, window, sinks):
    """The XLA path: `_gqa_attend` over the pages `paged.read` gives, heads cut to Dh."""
    b, h, dh = q.shape
    hkv = k.shape[1]
    keys, values = (paged.read(pool, jnp.asarray(table), seq_axis=2)[..., :dh] for pool in (k, v))
    positions = jnp.asarray(lens - 1)[:, None]
    sinks = None if sinks is None else sinks.reshape(hkv, h // hkv, 1, 1)
    q = q.reshape(b, hkv, h // hkv, 1, dh)
    return attention._gqa_attend(q, keys, values, positions, window, sinks, scale=SCALE).reshape(b, h, dh)


def xla(name: str, window: int = 0):
    q, k, v, sinks = inputs(CASES[name])
    return xla_path(q, k, v, TABLE, CASES[name].lens, window, sinks)


def tolerance(name: str) -> dict:
    """f32 to the XLA path's rounding; bf16 within bf16's (the XLA path rounds its scores and
    weights to bf16, the kernel keeps them in f32)."""
    return dict(rtol=2e-2, atol=2e-2) if CASES[name].dtype == "bfloat16" else dict(rtol=1e-5, atol=1e-5)


def assert_close(got, want, **tol):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)


@pytest.mark.parametrize("name", CASES)
def test_interpreted_kernel_equals_the_xla_path(name):
    got = run(name)
    assert got.shape == (len(TABLE), CASES[name].heads, CASES[name].head_dim) and got.dtype == CASES[name].dtype
    assert_close(got, xla(name), **tolerance(name))


def test_splits_past_a_copy_of_partials_are_merged_chunk_by_chunk():
    """The last split's CTA reads the other splits' partials PARTIALS_CHUNK at a time, in a loop:
    request 0's pages 8 and 9 are splits 8 and 9, in the second chunk."""
    case = CASES["splits_in_chunks"]
    assert case.splits - 1 > mgpu.partials_chunk(case.splits)
    lens = np.array([39, 30, 17], np.int32)
    q, k, v, sinks = inputs(case)
    got = run("splits_in_chunks", table=WIDE, lens=lens)
    assert_close(got, reference(q, k, v, WIDE, lens, sinks=np.asarray(sinks)), rtol=1e-5, atol=1e-5)


def test_a_sliding_window_masks_the_keys_before_it():
    """A window of 9 positions, traced (the same program as no window): the XLA path's window."""
    got = run("sinks_odd_pages", window=9)
    assert_close(got, xla("sinks_odd_pages", window=9), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(got - run("sinks_odd_pages"))).max() > 0.1  # it masks some keys


def reference(q, k, v, table, lens, window=0, sinks=None) -> np.ndarray:
    """float64 numpy: each query head's softmax over the positions in its window that its table
    names a page of the pool for, and its sink."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    pages, hkv, ps, _ = k.shape
    b, h, dh = q.shape
    out = np.zeros(q.shape)
    for i, n in enumerate(lens):
        p = np.arange(max(n - window, 0) if window else 0, n)
        p = p[(table[i, p // ps] >= 0) & (table[i, p // ps] < pages)]
        for j in range(h):
            keys, values = (x[table[i, p // ps], j // (h // hkv), p % ps, :dh] for x in (k, v))  # [n, Dh]
            logits = np.concatenate([keys @ q[i, j] * SCALE, [] if sinks is None else [sinks[j]]])
            if logits.size:
                w = np.exp(logits - logits.max())
                out[i, j] = w[: len(p)] @ values / w.sum()
    return out


def test_pages_the_table_names_none_are_read_as_nothing():
    """Slots inside a request's length that name no page (`pages`, or any id off the pool) mask
    their positions; a request with no position attends to its sink alone (zeros)."""
    table = TABLE.copy()
    table[0, 1], table[1, 0] = PAGES, -1
    lens = np.array([23, 16, 0], np.int32)
    case = CASES["sinks_odd_pages"]
    q, k, v, sinks = inputs(case)
    got = run("sinks_odd_pages", table=table, lens=lens)
    assert_close(got, reference(q, k, v, table, lens, sinks=np.asarray(sinks)), rtol=1e-5, atol=1e-5)
    assert not np.asarray(got[2]).any()


@functools.cache
def h100_program(splits: int) -> str:
    """Compiled text of a bf16 decode step's attention for an H100: 4 requests of 8 query heads
    over 2 kv heads of 128, pages of 16, tables of 32 pages, a traced window and sinks."""
    b, h, hkv, dh, ps, p = 4, 8, 2, 128, 16, 32
    step = jax.jit(
        lambda q, k, v, table, lens, window, sinks: mgpu.paged_attention(
            q, k, v, table, lens, scale=SCALE, window=window, sinks=sinks, pages_per_block=4, splits=splits
        )
    )
    pool = on_h100((64, hkv, ps, dh), jnp.bfloat16)
    args = (on_h100((b, h, dh), jnp.bfloat16), pool, pool, on_h100((b, p), jnp.int32), on_h100((b,), jnp.int32))
    return lower(step, *args, on_h100((), jnp.int32), on_h100((h,), jnp.float32)).compile().as_text()


@pytest.mark.parametrize("splits,launches", [(1, ["custom-call"]), (8, ["fusion", "custom-call"])])
def test_compiles_for_h100_into_one_mosaic_gpu_kernel(splits, launches):
    """Whole heads and query groups need no padding, so the program is the kernel alone; with
    splits, XLA zero-fills the semaphores first (the only other op), and the splits' combine is
    in the kernel."""
    text = h100_program(splits)
    runs = hlo.launches(text)
    assert sorted(r.instr.opcode for r in runs) == sorted(launches)
    assert [r.instr.target for r in runs if r.instr.opcode == "custom-call"] == ["mosaic_gpu_v2"]
    if splits > 1:  # a semaphore per (request, kv head)
        assert [r.instr.type for r in runs if r.instr.opcode == "fusion"] == ["s32[8]{0}"]


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(k=jnp.zeros((PAGES, 2, 8, 16), jnp.bfloat16)), "must match"),
        (dict(k=jnp.zeros((PAGES, 2, 8, 12)), v=jnp.zeros((PAGES, 2, 8, 12))), "whole 32-byte granules"),
        (dict(sinks=jnp.zeros(3)), "one logit per query head"),
        (dict(pages_per_block=256), "bytes of SMEM"),
    ],
    ids=["pools_unlike", "width_not_granules", "sinks_not_per_head", "smem"],
)
def test_bad_input_is_refused_with_the_reason(change, message):
    pool = jnp.zeros((PAGES, 2, 8, 16))
    args = dict(q=jnp.zeros((3, 4, 16)), k=pool, v=pool, table=jnp.asarray(TABLE), lens=jnp.zeros(3, jnp.int32))
    kw = dict(scale=SCALE, sinks=None, pages_per_block=1, splits=1)
    args.update({n: x for n, x in change.items() if n in args})
    kw.update({n: x for n, x in change.items() if n in kw})
    with pytest.raises(ValueError, match=message):
        mgpu.paged_attention(**args, **kw)


def test_this_jax_has_every_api_the_kernel_uses(monkeypatch):
    record = catalog.attention("mosaic_gpu")
    assert record.why_not("gpu") is None
    monkeypatch.delattr(mgpu.plgpu, "broadcasted_iota")
    assert "jax.experimental.pallas.mosaic_gpu.broadcasted_iota" in record.why_not("gpu")


# MLA's absorbed attention (`latent_attention`) over the pools latent [pages, ps, C] and k_rope
# [pages, ps, R], DSA's selection as a flag per position.
@dataclasses.dataclass(frozen=True)
class LatentCase:
    dtype: str
    page_size: int
    latent: int  # C
    rope: int  # R
    heads: int  # H
    heads_per_cta: int
    pages_per_block: int
    splits: int
    keeps: bool  # DSA's selection (else DeepSeek's MLA: every position)

    @property
    def lens(self) -> np.ndarray:
        ps = self.page_size
        return np.array([4 * ps - 1, 3 * ps - 2, ps - 3], np.int32)


LATENT_CASES = {
    # Pages of 6 (copies of 8 rows; request 0 reads the pool's last page, its flags shifted as its
    # rows), a latent of 40 f32 (5 register chunks of 8 columns), 6 heads in CTAs of 3, 3 splits.
    "odd_pages_head_groups": LatentCase("float32", 6, 40, 8, 6, 3, 2, 3, True),
    # bf16, a latent of 48 and a rope key of 16 (3 and 1 chunks), every head in one CTA (their
    # queries padded to whole copies), one split, no selection.
    "bf16_one_cta_per_request": LatentCase("bfloat16", 16, 48, 16, 6, 6, 1, 1, False),
    # A page per split over every page of the table (`WIDE`): 12 splits, partials in two copies.
    "splits_in_chunks": LatentCase("float32", 4, 24, 8, 2, 2, 1, 12, True),
}


def latent_inputs(case: LatentCase, table, seed: int = 0):
    """q [B, H, C], q_rope [B, H, R], pools latent [PAGES, ps, C], k_rope [PAGES, ps, R] and a
    selection keep [B, P * ps] that drops about a third of the positions."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    dtype, b, h, ps = jnp.dtype(case.dtype), len(table), case.heads, case.page_size
    q = jax.random.normal(keys[0], (b, h, case.latent)).astype(dtype)
    q_rope = jax.random.normal(keys[1], (b, h, case.rope)).astype(dtype)
    latent = jax.random.normal(keys[2], (PAGES, ps, case.latent)).astype(dtype)
    k_rope = jax.random.normal(keys[3], (PAGES, ps, case.rope)).astype(dtype)
    keep = jax.random.bernoulli(keys[4], 0.7, (b, table.shape[1] * ps))
    return jax.block_until_ready((q, q_rope, latent, k_rope, keep))


@functools.cache
def latent_kernel(case: LatentCase, interpret: bool = True):
    """The kernel of `case` (interpreted, or compiled for this GPU), jitted: one compile for any
    table or lens."""
    return jax.jit(
        lambda q, q_rope, latent, k_rope, table, lens, keep: mgpu.latent_attention(
            q,
            q_rope,
            latent,
            k_rope,
            table,
            lens,
            keep if case.keeps else None,
            scale=SCALE,
            heads=case.heads_per_cta,
            pages_per_block=case.pages_per_block,
            splits=case.splits,
            interpret=interpret,
        )
    )


def latent_reference(q, q_rope, latent, k_rope, table, lens, keep=None) -> np.ndarray:
    """float64 numpy: each head's softmax over the positions before its length that its table
    names a page of the pool for (and `keep` keeps), of q . latent + q_rope . k_rope, times the latent."""
    q, q_rope, latent, k_rope = (np.asarray(x, np.float64) for x in (q, q_rope, latent, k_rope))
    pages, ps, _ = latent.shape
    out = np.zeros(q.shape)
    for i, n in enumerate(lens):
        p = np.arange(n)
        p = p[(table[i, p // ps] >= 0) & (table[i, p // ps] < pages)]
        p = p if keep is None else p[np.asarray(keep)[i, p]]
        values, rope = latent[table[i, p // ps], p % ps], k_rope[table[i, p // ps], p % ps]
        for j in range(q.shape[1]):
            logits = (values @ q[i, j] + rope @ q_rope[i, j]) * SCALE
            if logits.size:
                w = np.exp(logits - logits.max())
                out[i, j] = w @ values / w.sum()
    return out


def run_latent(name: str, interpret: bool = True) -> tuple:
    """(the kernel's output of LATENT_CASES[name], waited for; the float64 reference's; the
    reference's with no selection), its tables TABLE (WIDE for "splits_in_chunks")."""
    case = LATENT_CASES[name]
    table, lens = (WIDE, np.array([39, 30, 17], np.int32)) if name == "splits_in_chunks" else (TABLE, case.lens)
    q, q_rope, latent, k_rope, keep = latent_inputs(case, table)
    got = latent_kernel(case, interpret)(q, q_rope, latent, k_rope, jnp.asarray(table), jnp.asarray(lens), keep)
    every = latent_reference(q, q_rope, latent, k_rope, table, lens)
    want = latent_reference(q, q_rope, latent, k_rope, table, lens, keep) if case.keeps else every
    return got.block_until_ready(), want, every


def latent_tolerance(name: str) -> dict:
    return dict(rtol=2e-2, atol=2e-2) if LATENT_CASES[name].dtype == "bfloat16" else dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", LATENT_CASES)
def test_interpreted_latent_attention_equals_a_float64_reference(name):
    """MLA's absorbed decode attention, against float64: partial last pages, empty table slots,
    heads in CTAs of fewer, splits combined, and DSA's selection where the case has one (the
    positions it drops change the output)."""
    case = LATENT_CASES[name]
    got, want, every = run_latent(name)
    assert got.shape == (3, case.heads, case.latent) and got.dtype == case.dtype
    assert_close(got, want, **latent_tolerance(name))
    assert not case.keeps or np.abs(want - every).max() > 0.1


@functools.cache
def latent_program(target: str, splits: int) -> str:
    """Compiled text of a bf16 decode step's MLA attention on `target`: 4 requests of 8 heads
    over a latent of 128 and a rope key of 64, pages of 16, tables of 16 pages, a selection."""
    b, h, c, r, ps, p = 4, 8, 128, 64, 16, 16
    step = jax.jit(
        lambda q, q_rope, latent, k_rope, table, lens, keep: mgpu.latent_attention(
            q, q_rope, latent, k_rope, table, lens, keep, scale=SCALE, heads=h, pages_per_block=4, splits=splits
        )
    )
    on = functools.partial(compile_only.on, target)
    args = [on((b, h, c), jnp.bfloat16), on((b, h, r), jnp.bfloat16), on((64, ps, c), jnp.bfloat16)]
    args += [on((64, ps, r), jnp.bfloat16), on((b, p), jnp.int32), on((b,), jnp.int32), on((b, p * ps), jnp.bool_)]
    return lower(step, *args).compile().as_text()


def latent_launches(text: str) -> dict:
    """A compiled `latent_program`'s launches: {"kernels": custom calls' targets, "fusions": types}."""
    runs = hlo.launches(text)
    return {
        "kernels": [r.instr.target for r in runs if r.instr.opcode == "custom-call"],
        "fusions": sorted(r.instr.type for r in runs if r.instr.opcode == "fusion"),
    }


def test_latent_attention_compiles_for_h100_into_one_mosaic_gpu_kernel():
    """The kernel, the selection laid out as its blocks (a fusion) and the split's semaphores
    zero-filled; nothing else (the B200's: `test_blackwell.py`, a process of its own)."""
    launches = latent_launches(latent_program("h100", 4))
    assert launches == {"kernels": ["mosaic_gpu_v2"], "fusions": ["f32[4,4,64]{2,1,0}", "s32[4]{0}"]}


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(k_rope=jnp.zeros((PAGES, 8, 24))), "must share R"),
        (dict(latent=jnp.zeros((PAGES, 8, 20)), q=jnp.zeros((3, 4, 20))), "whole 32-byte granules"),
        (dict(keep=jnp.ones((3, 5), bool)), "a flag per request and position"),
        (dict(heads=3), "not groups of 3"),
        (dict(pages_per_block=256), "bytes of SMEM"),
    ],
    ids=["rope_unlike", "latent_not_granules", "keep_not_per_position", "heads_not_groups", "smem"],
)
def test_bad_latent_input_is_refused_with_the_reason(change, message):
    args = dict(
        q=jnp.zeros((3, 4, 16)),
        q_rope=jnp.zeros((3, 4, 8)),
        latent=jnp.zeros((PAGES, 8, 16)),
        k_rope=jnp.zeros((PAGES, 8, 8)),
        table=jnp.asarray(TABLE),
        lens=jnp.zeros(3, jnp.int32),
        keep=None,
    )
    kw = dict(scale=SCALE, heads=4, pages_per_block=1, splits=1)
    args.update({n: x for n, x in change.items() if n in args})
    kw.update({n: x for n, x in change.items() if n in kw})
    with pytest.raises(ValueError, match=message):
        mgpu.latent_attention(**args, **kw)
