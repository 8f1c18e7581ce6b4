"""The KV cache as pages: a paged engine gives the contiguous engine's tokens and logits, on
every attention kind (GQA, MLA, DSA, gpt-oss windows and sinks), under every placement and
both attention modes, with the pages of each request scattered over the pool."""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.base.platform import resolve
from moejax.cli import build_parser
from moejax.compiled import hlo
from moejax.config import Config, EngineConfig, LayoutConfig, WeightsConfig, preset
from moejax.engine.engine import Engine
from moejax.engine.kv_cache import page_bytes
from moejax.engine.pages import PageAllocator
from moejax.launch.flags import config_from_args
from moejax.launch.loading import load_params
from moejax.model import paged
from moejax.serving.kv_pages import pool_pages
from moejax.serving.request import sampling_rows
from moejax.serving.slot_programs import decode_slots
from sharding import make_placement, names

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22]]
NEW = 6
MAX_LEN = 16  # both caches hold the same positions: the paged view equals the contiguous row (and the
# contiguous engine compiles the programs of test_placements.py's single-device runs)


@functools.cache
def run(model: str, page_size: int, placement: str = "", attention: str = "dp", fmt: str = "unquantized"):
    layout = (
        LayoutConfig(
            placement=placement, devices=8, attention=attention, head="tp" if attention == "tp" else "replicated"
        )
        if placement
        else LayoutConfig()
    )
    config = Config(
        model=preset(model),
        layout=layout,
        weights=WeightsConfig(fmt),
        engine=EngineConfig(page_size=page_size, max_seq_len=MAX_LEN),
    ).validate()
    placement_ = make_placement(config)
    return Engine(config, load_params(config, placement_, seed=1), placement_).generate(
        PROMPTS, NEW, return_logits=True
    )


def assert_same(got, ref):
    assert got.tokens == ref.tokens
    np.testing.assert_allclose(got.logits, ref.logits, rtol=0, atol=1e-4 * np.abs(ref.logits).max())


@pytest.mark.parametrize("verb", ["generate", "compare"])
def test_page_size_flag_pages_the_engine_cache(verb):
    """`--page-size` reaches engine.page_size (the engine then runs paged: the test below)."""
    args = build_parser().parse_args([verb, "--preset", "tiny", "--page-size", "4"])
    assert config_from_args(args).engine.page_size == 4
    assert config_from_args(build_parser().parse_args([verb, "--preset", "tiny"])).engine.page_size == 0


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny", "tiny-glm5", "tiny-gpt-oss"])
def test_paged_engine_gives_the_contiguous_tokens(model):
    assert_same(run(model, 4), run(model, 0))


@pytest.mark.parametrize("attention", ["dp", "tp"])
@pytest.mark.parametrize("placement", names())
@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-glm5"])
def test_paged_engine_under_every_placement(model, placement, attention):
    assert_same(run(model, 4, placement, attention), run(model, 0))


def test_paged_engine_with_nvfp4_experts():
    assert_same(run("tiny-gpt-oss", 4, "expert_sharded", "dp", "nvfp4"), run("tiny-gpt-oss", 0, fmt="nvfp4"))


def test_read_gives_the_pages_of_the_table_in_order():
    pool = jnp.arange(5 * 2 * 3, dtype=jnp.float32).reshape(5, 2, 3)  # [pages, page_size, R]
    view = paged.read(pool, jnp.asarray([[3, 1, 5]]), seq_axis=1)  # page 5: none
    np.testing.assert_array_equal(view[0], np.concatenate([pool[3], pool[1], np.zeros((2, 3))]))


def test_write_past_the_table_is_dropped():
    pool = jnp.zeros((2, 2, 1))
    table = jnp.asarray([[1]])  # one page: positions 0 and 1
    out = paged.write(pool, jnp.ones((1, 3, 1)), jnp.asarray([[0, 1, 2]]), table, seq_axis=1)
    np.testing.assert_array_equal(out[:, :, 0], [[0, 0], [1, 1]])


def test_allocator_hands_out_only_free_pages():
    a = PageAllocator(4, 16)
    first = a.allocate(3)
    assert a.allocate(2) is None and a.num_free == 1
    a.release(first)
    assert sorted(a.allocate(4)) == [0, 1, 2, 3]


def test_a_decode_step_copies_no_pool():
    config = Config(model=preset("tiny")).validate()  # MLA: its layer loop copied a layer's pools
    placement = make_placement(config)
    engine = Engine(config, load_params(config, placement), placement)
    pool = engine.new_pool(37, 4)  # a page count no other array has
    shapes = {s for a in jax.tree.leaves(pool) for s in (a.shape, a.shape[1:])}
    step = jax.jit(
        functools.partial(decode_slots, c=engine.c, placement=placement, greedy_only=True, extras=False),
        donate_argnums=1,
    )
    rows = sampling_rows([None, None], 2)[0]
    text = (
        step.lower(
            engine.params, pool, jnp.asarray([[3, 1], [5, 37]]), jnp.ones(2, jnp.int32), jnp.asarray([5, 9]), rows
        )
        .compile()
        .as_text()
    )
    assert "input_output_alias" in text  # the pool is donated
    program, writes = hlo.parse(text), hlo.writes_of(text, shapes, ordered=True)
    # The ops that may write a whole pool: its in-place scatters (anything else, a copy, slice or
    # update-slice fusion, copies the pool).
    scatters = [r for r in writes if program.root_of(r.instr).opcode == "scatter"]
    assert scatters and [r.instr.name for r in writes if r not in scatters] == []


def test_kv_cache_gb_holds_the_pages_its_bytes_hold_in_the_kernels_layout():
    """--kv-cache-gb: floor(bytes / page bytes) pages, a page as the attention kernel lays it out
    (in bf16 the TPU kernel's pool pads head_dim 24 to 128 lanes, the GPU kernel's to 32: whole
    32-byte granules; fewer pages in the same bytes)."""
    c = dataclasses.replace(preset("tiny-qwen3-moe"), head_dim=24)
    pages = {
        k: pool_pages(
            types.SimpleNamespace(
                c=c, dtype=jnp.bfloat16, placement=types.SimpleNamespace(attention_kernel=k, platform=resolve("cpu"))
            ),
            16,
            kv_gb=0.001,
        )
        for k in ("xla", "pallas_tpu", "mosaic_gpu")
    }
    assert pages == {k: 1e6 // page_bytes(c, 16, jnp.bfloat16, k) for k in pages}
    assert page_bytes(c, 16, jnp.bfloat16, "mosaic_gpu") == page_bytes(c, 16, jnp.bfloat16, "xla") * 32 // 24
    assert pages["pallas_tpu"] < pages["mosaic_gpu"] < pages["xla"]
