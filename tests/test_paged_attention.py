"""The Pallas paged-attention kernels read a page pool as the XLA path does: same outputs, same
pool, on a tiny GQA shape with scattered block tables and ragged lengths; and an engine that
decodes through one gives the XLA path's greedy tokens under placements of both attention modes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as tpu_module

from moejax.config import Config, ConfigError, EngineConfig, LayoutConfig, preset
from moejax.engine.engine import Engine
from moejax.loading import load_params
from moejax.model import attention, paged
from pallas_kernels import paged_attention as kernels
from sharding import make_placement
from sharding.placement import Placement

C = preset("tiny-qwen3-moe")  # 4 query heads over 2 kv heads of 16
PAGES, PAGE_SIZE = 12, 4
TABLE = np.array([[5, 2, 7], [1, 9, 0], [3, 11, 12]], np.int32)  # 12: no page (row 2 holds 2)
LENS = np.array([5, 12, 8])  # positions each request holds after the call


def inputs(t: int):
    """A pool of random k/v [pages, H_kv, ps, Dh], and the call's q, k, v [B, t, ...] at each
    request's last t positions."""
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    pool = {name: jax.random.normal(key, (PAGES, C.num_kv_heads, PAGE_SIZE, C.head_dim))
            for name, key in zip("kv", keys[:2])}
    b = len(LENS)
    q = jax.random.normal(keys[2], (b, t, C.num_heads, C.head_dim))
    k, v = (jax.random.normal(key, (b, t, C.num_kv_heads, C.head_dim)) for key in keys[3:])
    positions = jnp.asarray(LENS[:, None] - t + np.arange(t), jnp.int32)
    return q, k, v, positions, pool


def interleaved(pool: dict, kernel: str) -> dict:
    """The k/v pools as the TPU kernel's one pool [pages, ps, 2 * H_kv, Dh padded]."""
    kv = jnp.stack([pool["k"], pool["v"]], axis=2)  # [pages, H_kv, 2, ps, Dh]
    kv = jnp.moveaxis(kv, 3, 1).reshape(PAGES, PAGE_SIZE, 2 * C.num_kv_heads, C.head_dim)
    return {"kv": jnp.pad(kv, ((0, 0),) * 3 + ((0, kernels.head_dim(kernel, C.head_dim) - C.head_dim),))}


def xla(t: int):
    q, k, v, positions, pool = inputs(t)
    out, pool = attention._gqa_xla({}, q, k, v, positions, pool, C, Placement(Config(model=C)), 0, jnp.asarray(TABLE))
    return out, pool


def kernel(name: str, t: int):
    q, k, v, positions, pool = inputs(t)
    if kernels.combined(name):
        pool = interleaved(pool, name)
    # As layer 1 of a run of two: the kernel reads the run's pools flattened, layer 0's untouched.
    run = {k: jnp.stack([jnp.full_like(a, 7.0), a]) for k, a in pool.items()}
    out, run = paged.store_and_attend(name, C.softmax_scale, 0, q, k, v, positions,
                                      paged.LayerPages(jnp.asarray(TABLE), 1), run)
    assert all(bool((a[0] == 7.0).all()) for a in run.values())
    return out, {k: a[1] for k, a in run.items()}


def assert_close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5)


def test_gpu_kernel_interpreted_equals_the_xla_path_on_a_decode_step():
    (got, got_pool), (want, want_pool) = kernel("interpret_gpu", 1), xla(1)
    assert_close(got, want)
    for name in "kv":
        assert_close(got_pool[name], want_pool[name])


@pytest.mark.parametrize("t", [1, 3], ids=["decode", "prefill_chunk"])
def test_tpu_kernel_adapter_equals_the_xla_path(t, monkeypatch):
    """On the TPU kernel's own reference: Mosaic TPU's interpreter in JAX 0.10.2 cannot run the
    kernel (it reshapes a VMEM ref), so the layout, tables and lengths handed to it are checked
    here and the kernel itself lowers in `test_plan`'s export."""
    reference = lambda *a, num_kv_pages_per_block, num_queries_per_block, **kw: tpu_module.ref_ragged_paged_attention(*a, **kw)
    monkeypatch.setattr(tpu_module, "ragged_paged_attention", reference)
    (got, got_pool), (want, want_pool) = kernel("pallas_tpu", t), xla(t)
    assert_close(got, want)
    assert_close(got_pool["kv"], interleaved(want_pool, "pallas_tpu")["kv"])


@functools.cache
def tokens(attention_kernel: str, placement: str = "", mode: str = "dp", devices: int = 1):
    layout = LayoutConfig(placement=placement, devices=devices, attention=mode) if placement else LayoutConfig()
    config = Config(model=C, layout=layout, attention_kernel=attention_kernel,
                    engine=EngineConfig(page_size=4, max_seq_len=32)).validate()
    live = make_placement(config)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22]]
    return Engine(config, load_params(config, live, seed=1), live).generate(prompts, 4).tokens


# On 2 devices: DP attention, each its requests and their pages; TP attention, each its kv head.
@pytest.mark.parametrize("placement,mode,devices", [("expert_sharded", "dp", 2), ("tensor_sliced", "tp", 2)])
def test_engine_decoding_through_the_gpu_kernel_gives_the_xla_tokens(placement, mode, devices):
    assert tokens("interpret_gpu", placement, mode, devices) == tokens("xla")


@pytest.mark.parametrize("name", ["pallas_tpu", "pallas_gpu"])
def test_a_kernel_named_for_mla_is_refused_with_the_reason(name):
    config = Config(model=preset("tiny"), attention_kernel=name).validate()
    with pytest.raises(ConfigError, match="MLA and DSA cache one latent"):
        make_placement(config, platform={"pallas_tpu": "tpu", "pallas_gpu": "cuda"}[name])


def test_auto_reads_sinks_and_windows_through_xla():
    config = Config(model=preset("tiny-gpt-oss")).validate()
    assert make_placement(config, platform="tpu").attention_kernel == "xla"
    assert make_placement(Config(model=C).validate(), platform="tpu").attention_kernel == "pallas_tpu"
