"""The Pallas paged-attention kernels read a page pool as the XLA path does: same outputs, same
pool, on a tiny GQA shape with scattered block tables and ragged lengths (and, for the GPU's, a
sliding window and sinks); and an engine that decodes through the GPU's (in Mosaic GPU's
interpreter, on one device: under a mesh's shard_map the interpreter fails its own check that
every barrier is freed, "Barrier remains allocated") gives the XLA path's greedy tokens, for a
GQA model and for gpt-oss's sinks and windows. Every placement's decode step through it compiles
for 8 H100s in `test_target_compiles.py`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_only import lower, on_h100
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as tpu_module

from moejax.base import targets
from moejax.base.platform import resolve
from moejax.compiled import hlo
from moejax.config import Config, ConfigError, EngineConfig, LayoutConfig, preset
from moejax.engine.engine import Engine
from moejax.engine.kv_cache import init_pool
from moejax.launch.loading import load_params
from moejax.model import attention, paged
from pallas_kernels import paged_attention as kernels
from pallas_kernels import paged_attention_mgpu as mgpu
from pallas_kernels import tiles
from pallas_kernels.paged_layout_mgpu import SMEM_BYTES, latent_smem_bytes, smem_bytes
from sharding import make_placement
from sharding.placement import Placement

C = preset("tiny-qwen3-moe")  # 4 query heads over 2 kv heads of 16
# Widths the GPU kernel pads: heads of 20 (its f32 pool pads them to 24, bf16 to 32: whole 32-byte
# granules), 3 query heads per kv head (its queries padded to whole copies) and (with a page size
# of 6) pages copied as 8 rows, the rows after them masked.
ODD = dataclasses.replace(C, head_dim=20, num_heads=6)
GPT_OSS = preset("tiny-gpt-oss")  # sinks, and sliding-window layers (their own page group)
# MLA and DSA: a dense layer and a MoE layer with an indexer (few layers: the kernel is slow interpreted).
GLM = dataclasses.replace(preset("tiny-glm-5.3"), num_layers=2, dsa_shared_layers=())
PAGES, PAGE_SIZE = 12, 4
TABLE = np.array([[5, 2, 7], [1, 9, 0], [3, 11, 12]], np.int32)  # 12: no page (row 2 holds 2)
LENS = np.array([5, 12, 8])  # positions each request holds after the call


def inputs(t: int, c=C, page_size=PAGE_SIZE):
    """A pool of random k/v [pages, H_kv, ps, Dh], and the call's q, k, v [B, t, ...] at each
    request's last t positions."""
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    pool = {
        name: jax.random.normal(key, (PAGES, c.num_kv_heads, page_size, c.head_dim))
        for name, key in zip("kv", keys[:2])
    }
    b = len(LENS)
    q = jax.random.normal(keys[2], (b, t, c.num_heads, c.head_dim))
    k, v = (jax.random.normal(key, (b, t, c.num_kv_heads, c.head_dim)) for key in keys[3:])
    positions = jnp.asarray(LENS[:, None] - t + np.arange(t), jnp.int32)
    return q, k, v, positions, pool


def interleaved(pool: dict, kernel: str, c=C) -> dict:
    """The k/v pools as the TPU kernel's one pool [pages, ps, 2 * H_kv, Dh padded]."""
    kv = jnp.stack([pool["k"], pool["v"]], axis=2)  # [pages, H_kv, 2, ps, Dh]
    kv = jnp.moveaxis(kv, 3, 1).reshape(PAGES, kv.shape[3], 2 * c.num_kv_heads, c.head_dim)
    return {"kv": paged.widen(kv, kernels.head_dim(kernel, c.head_dim, jnp.float32))}


def xla(t: int, c=C, page_size=PAGE_SIZE, width=None, window=0, sinks=None):
    """The XLA path's output and pools (heads padded to `width` as a kernel's pools are), keys
    older than `window` masked and `sinks` [H] (or None) in the softmax."""
    q, k, v, positions, pool = inputs(t, c, page_size)
    pool = {name: paged.widen(a, width or c.head_dim) for name, a in pool.items()}
    c = dataclasses.replace(c, attention_sinks=sinks is not None)
    p = {} if sinks is None else {"sinks": sinks}
    placement = Placement(Config(model=c))
    return attention._gqa_xla(p, q, k, v, positions, pool, c, placement, window, jnp.asarray(TABLE))


def kernel(name: str, t: int, c=C, page_size=PAGE_SIZE, window=0, sinks=None):
    q, k, v, positions, pool = inputs(t, c, page_size)
    if kernels.combined(name):
        pool = interleaved(pool, name, c)
        k, v = paged.interleaved(k, v), None  # its pool's rows, as the TPU's q|k|v kernel writes them
    else:
        pool = {n: paged.widen(a, kernels.head_dim(name, c.head_dim, jnp.float32)) for n, a in pool.items()}
    # As layer 1 of a run of two: the kernel reads the run's pools flattened, layer 0's untouched.
    run = {k: jnp.stack([jnp.full_like(a, 7.0), a]) for k, a in pool.items()}
    out, run = paged.store_and_attend(
        name, c.softmax_scale, window, 0, q, k, v, positions, paged.LayerPages(jnp.asarray(TABLE), 1), run, sinks
    )
    assert all(bool((a[0] == 7.0).all()) for a in run.values())
    return out, {k: a[1] for k, a in run.items()}


def assert_close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5)


@pytest.mark.parametrize("c,page_size", [(C, PAGE_SIZE), (ODD, 6)], ids=["pow2", "odd"])
def test_gpu_kernel_interpreted_equals_the_xla_path_on_a_decode_step(c, page_size):
    """The Mosaic GPU kernel (interpreted) reads and writes its pools as the XLA path does; at odd
    widths its pools' heads are padded (zeros after each head's Dh: the scores and the kept
    output columns are unchanged, and the softmax scale is the model's)."""
    (got, got_pool), (want, want_pool) = kernel("interpret_mosaic_gpu", 1, c, page_size), xla(1, c, page_size)
    assert_close(got, want)
    for name in "kv":
        assert_close(got_pool[name][..., : c.head_dim], want_pool[name])
        assert not got_pool[name][..., c.head_dim :].any()


def test_gpu_kernel_interpreted_masks_a_window_and_adds_sinks_as_the_xla_path():
    """gpt-oss's attention at odd widths: a window of 5 positions (requests hold up to 12) and a
    sink logit per query head, as the XLA path masks and adds them (each changes the output)."""
    sinks = jax.random.normal(jax.random.PRNGKey(1), (ODD.num_heads,))
    got, _ = kernel("interpret_mosaic_gpu", 1, ODD, 6, window=5, sinks=sinks)
    assert_close(got, xla(1, ODD, 6, window=5, sinks=sinks)[0])
    for other in (xla(1, ODD, 6, window=5)[0], xla(1, ODD, 6, sinks=sinks)[0]):
        assert np.abs(np.asarray(got - other)).max() > 1e-2


# (B, H_kv, G, W, page_size, P, dtype) -> (pages_per_block, splits). Qwen3-30B-A3B in bf16 and f32 at
# batch 1 (33 splits cover the 132 SMs once) and 64 (one split: 256 CTAs); gpt-oss-120b's heads at
# batch 1 (17 splits of 8 kv heads); a short table (one block: one split).
BLOCKS = {
    (1, 4, 8, 128, 16, 256, "bfloat16"): (4, 33),
    (64, 4, 8, 128, 16, 256, "bfloat16"): (4, 1),
    (1, 4, 8, 128, 16, 256, "float32"): (4, 33),
    (1, 8, 8, 64, 16, 512, "bfloat16"): (4, 17),
    (4, 2, 2, 16, 4, 8, "float32"): (8, 1),
}


H100 = ("NVIDIA H100 80GB HBM3", 132)  # (device kind, SMs), as `platform.tile_device` gives them


@pytest.mark.parametrize("shape", BLOCKS)
def test_gpu_blocks_fit_smem_and_cover_the_sms(shape):
    """The GPU kernel's blocks on an H100: pages filling the 64-row register tile, as many splits as
    cover the SMs the table's waves times where the table has the blocks and SMEM the partials, and
    no more (one more split would not fit, or would reach past the waves, the table's blocks or its
    most)."""
    b, hkv, g, w, ps, p, dtype = shape
    pages, splits = kernels.gpu_blocks(b, hkv, g, w, ps, p, dtype, H100)
    rule = tiles.lookup("paged_attention_mgpu", H100)
    assert (pages, splits) == BLOCKS[shape]
    assert smem_bytes(g, w, ps, pages, splits, dtype) <= SMEM_BYTES
    assert (
        smem_bytes(g, w, ps, pages, splits + 1, dtype) > SMEM_BYTES
        or splits * b * hkv >= rule["waves"] * H100[1]
        or splits == -(-p // pages)
        or splits == rule["max_splits"]
    )


# MLA shapes (B, H, C, R, page size, P): GLM-5.3's 64 heads of a device under DP attention (8
# requests), its 8 under TP attention (64 requests), and a small latent.
LATENT_BLOCKS = [(8, 64, 512, 64, 16, 256), (64, 8, 512, 64, 64, 64), (4, 16, 64, 16, 4, 8)]


@pytest.mark.parametrize("shape", LATENT_BLOCKS)
def test_latent_blocks_take_the_most_heads_smem_holds(shape):
    """The MLA attention's heads a CTA on an H100: a divisor of H, the largest whose CTA fits SMEM
    (all H where they fit: the latent read once for them), and `gpu_blocks`' rule for the rest."""
    b, h, c, r, ps, p = shape
    heads, pages, splits = kernels.latent_blocks(b, h, c, r, ps, p, "bfloat16", H100)
    assert h % heads == 0
    assert latent_smem_bytes(heads, c, r, ps, pages, splits, "bfloat16") <= SMEM_BYTES
    larger = [n for n in range(heads + 1, h + 1) if h % n == 0]
    assert all(latent_smem_bytes(n, c, r, ps, 1, 1, "bfloat16") > SMEM_BYTES for n in larger)
    waves = tiles.lookup("paged_attention_mgpu", H100)["waves"]
    assert splits <= -(-waves * H100[1] // (b * (h // heads)))  # CTAs cover the SMs about `waves` times


@pytest.mark.parametrize("t", [1, 3], ids=["decode", "prefill_chunk"])
def test_xla_path_reads_a_kernels_wider_pool(t):
    """A prefill chunk (the XLA path: the GPU kernel reads decode steps only) over the GPU kernel's
    pools, heads padded from 20 to 24: the output the model's own pools give, and zeros after
    each head."""
    width = kernels.head_dim("mosaic_gpu", ODD.head_dim, jnp.float32)
    (got, got_pool), (want, want_pool) = xla(t, ODD, 6, width), xla(t, ODD, 6)
    assert got_pool["k"].shape[-1] == width == 24
    assert_close(got, want)
    for name in "kv":
        assert_close(got_pool[name][..., : ODD.head_dim], want_pool[name])
        assert not got_pool[name][..., ODD.head_dim :].any()


@pytest.mark.parametrize(
    "c,page_size,width",
    [(ODD, 16, 16), (C, 12, 8), (C, 16, 48), (preset("tiny-gpt-oss"), 16, 8)],
    ids=["heads_20_in_groups_of_3", "pages_of_12", "table_of_48", "window_and_sinks"],
)
def test_gpu_kernel_compiles_for_h100_at_any_width(c, page_size, width):
    """A decode step's paged attention through the Mosaic GPU kernel, over the pools `init_pool`
    makes for it in bf16 (heads of 20 padded to 32; pages of 12 copied as 16 rows; a table of 48
    pages in splits; a window layer's window and sinks), compiles for an H100 into its kernel."""
    pool = jax.eval_shape(lambda: init_pool(c, PAGES, page_size, jnp.bfloat16, "mosaic_gpu", PAGES))[0]
    group = bool(c.sliding_layers)  # gpt-oss: its window layers' own pools
    pool = {paged.base(name): on_h100(a.shape, a.dtype) for name, a in pool.items() if paged.in_window(name) == group}
    b = 4
    q, k, v = (on_h100((b, 1, h, c.head_dim), jnp.bfloat16) for h in (c.num_heads, c.num_kv_heads, c.num_kv_heads))
    sinks = on_h100((c.num_heads,), jnp.float32) if c.attention_sinks else None
    step = jax.jit(
        lambda q, k, v, positions, table, pool, sinks: paged.store_and_attend(
            "mosaic_gpu",
            c.softmax_scale,
            c.sliding_window,
            0,
            q,
            k,
            v,
            positions,
            paged.LayerPages(table, 1),
            pool,
            sinks,
        ),
        donate_argnums=5,
    )
    table = on_h100((b, width), jnp.int32)
    text = lower(step, q, k, v, on_h100((b, 1), jnp.int32), table, pool, sinks).compile().as_text()
    assert [(r.instr.pallas, r.instr.kernel) for r in hlo.pallas_calls(text)] == [("mosaic_gpu", mgpu.NAME)]


@pytest.mark.parametrize("t", [1, 3], ids=["decode", "prefill_chunk"])
def test_tpu_kernel_adapter_equals_the_xla_path(t, monkeypatch):
    """On the TPU kernel's own reference: Mosaic TPU's interpreter in JAX 0.10.2 cannot run the
    kernel (it reshapes a VMEM ref), so the layout, tables and lengths handed to it are checked
    here and the kernel itself lowers in `test_plan`'s export."""
    reference = lambda *a, num_kv_pages_per_block, num_queries_per_block, **kw: tpu_module.ref_ragged_paged_attention(
        *a, **kw
    )
    monkeypatch.setattr(tpu_module, "ragged_paged_attention", reference)
    (got, got_pool), (want, want_pool) = kernel("pallas_tpu", t), xla(t)
    assert_close(got, want)
    assert_close(got_pool["kv"], interleaved(want_pool, "pallas_tpu")["kv"])


def test_tp_attention_slices_the_sinks_as_the_heads_on_h100s():
    """Under TP attention each device attends its kv head's query heads over its slice of the
    pools: the kernel a device runs gets those heads' sinks, [1 kv head, 2 query heads]."""
    layout = LayoutConfig(placement="tensor_sliced", devices=2, attention="tp")
    config = Config(model=GPT_OSS, layout=layout, attention_kernel="mosaic_gpu").validate()
    placement = make_placement(config, platform=resolve("cuda"), devices=list(targets.devices("h100", 2)))
    replicated = jax.sharding.NamedSharding(placement.mesh, jax.sharding.PartitionSpec())
    on = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
    c, b = GPT_OSS, 4
    pool = jax.eval_shape(lambda: init_pool(c, PAGES, 16, jnp.bfloat16, "mosaic_gpu", PAGES))[0]
    pool = {paged.base(name): on(a.shape) for name, a in pool.items() if paged.in_window(name)}
    attend = functools.partial(paged.store_and_attend, "mosaic_gpu", c.softmax_scale, c.sliding_window)
    step = jax.jit(
        lambda q, k, v, positions, table, pool, sinks: placement.on_pages(
            attend, q, k, v, positions, paged.LayerPages(table, 0), pool, sinks
        )
    )
    q, k, v = (on((b, 1, h, c.head_dim)) for h in (c.num_heads, c.num_kv_heads, c.num_kv_heads))
    args = (on((b, 1), jnp.int32), on((b, 8), jnp.int32), pool, on((c.num_heads,), jnp.float32))
    text = lower(step, q, k, v, *args).compile().as_text()
    [call] = [r.instr for r in hlo.pallas_calls(text) if r.instr.kernel == mgpu.NAME]
    assert (c.num_kv_heads, c.num_heads) == (2, 4) and "f32[1,2]" in call.operand_types


MODELS = {
    "gqa": C,
    "odd": ODD,
    "gpt_oss": GPT_OSS,
    "glm": preset("tiny-glm-5.3"),
}  # by name: a config with dicts is no cache key


@functools.cache
def tokens(attention_kernel: str, model: str = "gqa", page_size=4):
    """A one-device engine's greedy tokens for MODELS[model], decode steps through `attention_kernel`."""
    config = Config(
        model=MODELS[model], attention_kernel=attention_kernel, engine=EngineConfig(page_size=page_size, max_seq_len=32)
    ).validate()
    live = make_placement(config)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22]]
    return Engine(config, load_params(config, live, seed=1), live).generate(prompts, 4).tokens


def test_engine_decoding_through_the_gpu_kernel_at_odd_widths_gives_the_xla_tokens():
    """GQA's decode steps through the kernel at widths it pads: `init_pool` pads the kernel's pools'
    heads (20 to 24), prefill chunks write and read them through XLA, decode steps through the
    kernel: the XLA path's tokens over its own pools."""
    assert tokens("interpret_mosaic_gpu", "odd", page_size=6) == tokens("xla", "odd", page_size=6)


def test_engine_decoding_gpt_oss_through_the_gpu_kernel_gives_the_xla_tokens(monkeypatch):
    """gpt-oss's decode steps through the kernel: its window layers' over their own page group with
    their window masked (requests outgrow it), its full layers' over theirs, all with the sinks
    (as the kernel is traced: every layer unrolled, each knows its group)."""
    seen = set()
    traced = mgpu.paged_attention

    def spy(*args, window, sinks, **kw):
        seen.add((window, sinks is not None))
        return traced(*args, window=window, sinks=sinks, **kw)

    monkeypatch.setattr(mgpu, "paged_attention", spy)
    assert tokens("interpret_mosaic_gpu", "gpt_oss") == tokens("xla", "gpt_oss")
    assert seen == {(0, True), (GPT_OSS.sliding_window, True)}


def test_engine_decoding_glm_through_the_gpu_kernel_gives_the_xla_tokens(monkeypatch):
    """GLM-5.3's MLA decode steps through the kernel's `latent_attention` (the latent and rope pools
    as the XLA path keeps them), each over its DSA selection (past `index_topk` positions it drops
    some): the XLA path's tokens."""
    kept = []
    traced = mgpu.latent_attention

    def spy(q, q_rope, latent, k_rope, table, lens, keep, **kw):
        kept.append(keep is not None)
        return traced(q, q_rope, latent, k_rope, table, lens, keep, **kw)

    monkeypatch.setattr(mgpu, "latent_attention", spy)
    assert tokens("interpret_mosaic_gpu", "glm") == tokens("xla", "glm")
    assert kept and all(kept)


def test_the_tpu_kernel_named_for_mla_is_refused_with_the_reason():
    config = Config(model=preset("tiny"), attention_kernel="pallas_tpu").validate()
    with pytest.raises(ConfigError, match="MLA and DSA cache one latent"):
        make_placement(config, platform=resolve("tpu"))


def test_the_gpu_kernel_named_for_mla_rows_of_no_whole_granules_is_refused_with_the_reason():
    """The tiny model's rope key of 8 is 16 bytes in bf16: no TMA copy of whole granules."""
    config = Config(model=preset("tiny"), attention_kernel="mosaic_gpu", engine=EngineConfig(dtype="bfloat16"))
    with pytest.raises(ConfigError, match=r"rope key \(8\) must be whole 32-byte rows in bfloat16"):
        make_placement(config.validate(), platform=resolve("cuda"))


@pytest.mark.parametrize(
    "platform,kernel,gemm", [("tpu", "pallas_tpu", "pallas_tpu"), ("cuda", "mosaic_gpu", "triton")]
)
def test_auto_reads_what_the_kernels_cannot_through_xla(platform, kernel, gemm):
    """`auto` takes the platform's kernels wherever they read the model (any head width, GQA
    group, expert width; the GPU's sinks and windows, and MLA, too) and reads its pages through
    XLA where they cannot (the TPU's MLA, sinks and windows)."""
    # MLA: the rope key of 16 is whole 32-byte rows in bf16 (the GPU's run dtype), the tiny model's 8 is not.
    for rope, reads in ((8, False), (16, kernels.reads_latent(kernel))):
        mla = Config(model=dataclasses.replace(preset("tiny"), qk_rope_head_dim=rope)).validate()
        assert make_placement(mla, platform=resolve(platform)).attention_kernel == (kernel if reads else "xla")
    windows = make_placement(Config(model=GPT_OSS).validate(), platform=resolve(platform)).attention_kernel
    assert windows == (kernel if kernels.reads_windows(kernel) else "xla")
    for c in (C, ODD, dataclasses.replace(ODD, hidden_size=40, moe_intermediate_size=24)):
        placement = make_placement(Config(model=c).validate(), platform=resolve(platform))
        assert (placement.attention_kernel, placement.kernel) == (kernel, gemm)


def test_the_tpu_kernel_named_for_sinks_and_windows_is_refused_with_the_reason():
    config = Config(model=GPT_OSS, attention_kernel="pallas_tpu").validate()
    with pytest.raises(ConfigError, match="^attention kernel pallas_tpu: its softmax takes no attention sinks"):
        make_placement(config, platform=resolve("tpu"))
