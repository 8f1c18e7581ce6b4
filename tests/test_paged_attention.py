"""The Pallas paged-attention kernels read a page pool as the XLA path does: same outputs, same
pool, on a tiny GQA shape with scattered block tables and ragged lengths; and an engine that
decodes through one gives the XLA path's greedy tokens under placements of both attention modes."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_only import on_h100
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as tpu_module

from moejax.config import Config, ConfigError, EngineConfig, LayoutConfig, preset
from moejax.engine.engine import Engine
from moejax.engine.kv_cache import init_pool
from moejax.loading import load_params
from moejax.model import attention, paged
from moejax.platform import resolve
from pallas_kernels import paged_attention as kernels
from sharding import make_placement
from sharding.placement import Placement

C = preset("tiny-qwen3-moe")  # 4 query heads over 2 kv heads of 16
# Widths Triton's power-of-two blocks do not take as they are: heads of 24 (the kernel's pool pads
# them to 32), 3 query heads per kv head (the kernel pads them to its block of 16), and (with a
# page size of 6) pages read as sub-pages of 2.
ODD = dataclasses.replace(C, head_dim=24, num_heads=6)
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
    return {"kv": paged.widen(kv, kernels.head_dim(kernel, c.head_dim))}


def xla(t: int, c=C, page_size=PAGE_SIZE, width=None):
    """The XLA path's output and pools (heads padded to `width` as a kernel's pools are)."""
    q, k, v, positions, pool = inputs(t, c, page_size)
    pool = {name: paged.widen(a, width or c.head_dim) for name, a in pool.items()}
    out, pool = attention._gqa_xla({}, q, k, v, positions, pool, c, Placement(Config(model=c)), 0, jnp.asarray(TABLE))
    return out, pool


def kernel(name: str, t: int, c=C, page_size=PAGE_SIZE):
    q, k, v, positions, pool = inputs(t, c, page_size)
    if kernels.combined(name):
        pool = interleaved(pool, name, c)
    else:
        pool = {n: paged.widen(a, kernels.head_dim(name, c.head_dim)) for n, a in pool.items()}
    # As layer 1 of a run of two: the kernel reads the run's pools flattened, layer 0's untouched.
    run = {k: jnp.stack([jnp.full_like(a, 7.0), a]) for k, a in pool.items()}
    out, run = paged.store_and_attend(
        name, c.softmax_scale, 0, q, k, v, positions, paged.LayerPages(jnp.asarray(TABLE), 1), run
    )
    assert all(bool((a[0] == 7.0).all()) for a in run.values())
    return out, {k: a[1] for k, a in run.items()}


def assert_close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5)


@pytest.mark.parametrize("c,page_size", [(C, PAGE_SIZE), (ODD, 6)], ids=["pow2", "odd"])
def test_gpu_kernel_interpreted_equals_the_xla_path_on_a_decode_step(c, page_size):
    """The Triton kernel (interpreted) reads and writes its pools as the XLA path does; at odd
    widths its pools' heads are padded (zeros after each head's Dh: the scores and the kept
    output columns are unchanged, and the softmax scale is the model's)."""
    (got, got_pool), (want, want_pool) = kernel("interpret_gpu", 1, c, page_size), xla(1, c, page_size)
    assert_close(got, want)
    for name in "kv":
        assert_close(got_pool[name][..., : c.head_dim], want_pool[name])
        assert not got_pool[name][..., c.head_dim :].any()


@pytest.mark.parametrize("t", [1, 3], ids=["decode", "prefill_chunk"])
def test_xla_path_reads_a_kernels_wider_pool(t):
    """A prefill chunk (the XLA path: the Triton kernel reads decode steps only) over the Triton
    kernel's pools, heads padded from 24 to 32: the output the model's own pools give, and zeros
    after each head."""
    (got, got_pool), (want, want_pool) = xla(t, ODD, 6, kernels.head_dim("pallas_gpu", 24)), xla(t, ODD, 6)
    assert got_pool["k"].shape[-1] == 32
    assert_close(got, want)
    for name in "kv":
        assert_close(got_pool[name][..., :24], want_pool[name])
        assert not got_pool[name][..., 24:].any()


# Each once refused by Triton's lowering ("an array of shape ..."): heads of 24 ((16, 24)), a page
# of 12 positions ((1, 12, 16)), a table of 48 pages in 16 splits of 3 ((3,)).
@pytest.mark.parametrize(
    "c,page_size,width",
    [(ODD, 16, 16), (C, 12, 8), (C, 16, 48)],
    ids=["heads_24_in_groups_of_3", "pages_of_12", "table_of_48"],
)
def test_gpu_kernel_compiles_for_h100_at_any_width(c, page_size, width):
    """A decode step's paged attention through the Triton kernel, over the pools `init_pool` makes
    for it, compiles for an H100."""
    pool = jax.eval_shape(lambda: init_pool(c, PAGES, page_size, jnp.bfloat16, "pallas_gpu"))[0]
    pool = {name: on_h100(a.shape, a.dtype) for name, a in pool.items()}
    b = 4
    q, k, v = (on_h100((b, 1, h, c.head_dim), jnp.bfloat16) for h in (c.num_heads, c.num_kv_heads, c.num_kv_heads))
    step = jax.jit(
        lambda q, k, v, positions, table, pool: paged.store_and_attend(
            "pallas_gpu", c.softmax_scale, 0, q, k, v, positions, paged.LayerPages(table, 1), pool
        ),
        donate_argnums=5,
    )
    hlo = step.lower(q, k, v, on_h100((b, 1), jnp.int32), on_h100((b, width), jnp.int32), pool).compile().as_text()
    assert "__gpu$xla.gpu.triton" in hlo


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


@functools.cache
def tokens(attention_kernel: str, placement: str = "", mode: str = "dp", devices: int = 1, c=C, page_size=4):
    layout = LayoutConfig(placement=placement, devices=devices, attention=mode) if placement else LayoutConfig()
    config = Config(
        model=c,
        layout=layout,
        attention_kernel=attention_kernel,
        engine=EngineConfig(page_size=page_size, max_seq_len=32),
    ).validate()
    live = make_placement(config)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22]]
    return Engine(config, load_params(config, live, seed=1), live).generate(prompts, 4).tokens


# On 2 devices: DP attention, each its requests and their pages; TP attention, each its kv head.
@pytest.mark.parametrize("placement,mode,devices", [("expert_sharded", "dp", 2), ("tensor_sliced", "tp", 2)])
def test_engine_decoding_through_the_gpu_kernel_gives_the_xla_tokens(placement, mode, devices):
    assert tokens("interpret_gpu", placement, mode, devices) == tokens("xla")


def test_engine_decoding_through_the_gpu_kernel_at_odd_widths_gives_the_xla_tokens():
    """`init_pool` pads the kernel's pools' heads (24 to 32), prefill chunks write and read them
    through XLA, decode steps through the kernel: the XLA path's tokens over its own pools."""
    assert tokens("interpret_gpu", c=ODD, page_size=6) == tokens("xla", c=ODD, page_size=6)


@pytest.mark.parametrize("name", ["pallas_tpu", "pallas_gpu"])
def test_a_kernel_named_for_mla_is_refused_with_the_reason(name):
    config = Config(model=preset("tiny"), attention_kernel=name).validate()
    with pytest.raises(ConfigError, match="MLA and DSA cache one latent"):
        make_placement(config, platform=resolve({"pallas_tpu": "tpu", "pallas_gpu": "cuda"}[name]))


@pytest.mark.parametrize("platform,kernel", [("tpu", "pallas_tpu"), ("cuda", "pallas_gpu")])
def test_auto_reads_sinks_windows_and_mla_through_xla(platform, kernel):
    """`auto` takes the platform's kernels wherever they read the model (any head width, GQA
    group, expert width) and reads its pages through XLA where they cannot."""
    for model in ("tiny-gpt-oss", "tiny"):  # sinks and windows; MLA
        assert (
            make_placement(Config(model=preset(model)).validate(), platform=resolve(platform)).attention_kernel == "xla"
        )
    for c in (C, ODD, dataclasses.replace(ODD, hidden_size=40, moe_intermediate_size=24)):
        placement = make_placement(Config(model=c).validate(), platform=resolve(platform))
        assert (placement.attention_kernel, placement.kernel) == (kernel, kernel)


def test_a_kernel_named_for_sinks_and_windows_is_refused_with_the_reason():
    config = Config(model=preset("tiny-gpt-oss"), attention_kernel="pallas_gpu").validate()
    with pytest.raises(
        ConfigError, match="^attention kernel pallas_gpu: the kernels' softmax takes no attention sinks"
    ):
        make_placement(config, platform=resolve("cuda"))
