"""DP attention over a paged KV cache: each rank holds its share of the pool's pages, its requests
hold only those, and every device reads and writes its own pages (no page crosses devices in a
decode step); the scheduler's tokens equal the single-device engine's through preemption, prefix
cache hits and n samples."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from moejax.base.errors import UsageError
from moejax.base.platform import resolve
from moejax.compiled import hlo
from moejax.compiled.plan import kv_pages
from moejax.config import Config, EngineConfig, LayoutConfig, preset
from moejax.engine.engine import Engine
from moejax.engine.kv_cache import page_bytes
from moejax.launch.loading import load_mtp, load_params
from moejax.model.mtp import init_mtp_pool
from moejax.serving.kv_pages import KVPages
from moejax.serving.request import Request, sampling_rows
from moejax.serving.scheduler import Scheduler
from moejax.serving.slot_programs import decode_slots, fork_slots
from moejax.serving.speculative import SpecScheduler, spec_decode_slots
from moejax.serving.stopping import Stopper
from sharding import make_placement

DP4 = LayoutConfig(placement="expert_sharded", devices=4, attention="dp")
PS = 3  # positions per page in the HLO checks: a size no other array ends in


def engine_on(model, layout=LayoutConfig(), chunk: int = 0, first: int = 0) -> Engine:
    config = Config(model=model, layout=layout, engine=EngineConfig(prefill_chunk=chunk)).validate()
    devices = jax.devices()[first : first + layout.devices] if layout.devices > 1 else None
    placement = make_placement(config, devices=devices)
    return Engine(config, load_params(config, placement, seed=1), placement)


def moved_pages(text: str, pools) -> list[str]:
    """Collectives of a compiled program that carry pages: an array ending in a page's positions
    and what each position holds ([.., page_size, R] or [.., page_size, Dh]) (the pool or pages read from it)."""
    tails = {tuple(a.shape[-2:]) for a in jax.tree.leaves(pools)}
    return [
        f"{r.instr.name} = {r.instr.type} {r.instr.opcode}"
        for r in hlo.collectives(text)
        if any(s[-2:] in tails for s in r.instr.shapes)
    ]


def tables(n: int, pages: int, ranks: int = 4) -> jax.Array:
    """Block tables [n, 2]: row i on rank i * ranks // n, its pages the rank's first two."""
    per = pages // ranks
    return jnp.asarray([[r * per, r * per + 1] for r in (i * ranks // n for i in range(n))], jnp.int32)


MODEL = preset("tiny-qwen3-moe")


@pytest.fixture(scope="module")
def dp_engine():
    """GQA on 4 DP ranks; prefill calls of 8 positions."""
    return engine_on(MODEL, DP4, chunk=8)


def test_a_gqa_decode_step_under_dp_attention_moves_no_pages(dp_engine):
    engine = dp_engine
    pool = engine.new_pool(16, PS)
    step = jax.jit(
        functools.partial(decode_slots, c=engine.c, placement=engine.placement, greedy_only=True, extras=False),
        donate_argnums=1,
    )
    text = (
        step.lower(
            engine.params,
            pool,
            tables(4, 16),
            jnp.ones(4, jnp.int32),
            jnp.asarray([4, 2, 5, 1]),
            sampling_rows([None] * 4, 4)[0],
        )
        .compile()
        .as_text()
    )
    assert hlo.collectives(text)  # the step has its MoE exchange
    moved = moved_pages(text, pool)
    assert not moved, moved


def test_a_speculative_decode_step_on_mla_dsa_and_the_mtp_pool_moves_no_pages():
    """MLA latent, rope key, DSA indexer keys and the MTP layer's own pool, one step."""
    engine = engine_on(preset("tiny-glm5"), DP4)
    mtp = load_mtp(engine.config, engine.placement)
    pool = engine.new_pool(16, PS)
    mtp_pool = engine.placement.zeros_cache(lambda: [init_mtp_pool(engine.c, 16, PS, engine.dtype)], pool=True)[0]
    step = jax.jit(functools.partial(spec_decode_slots, c=engine.c, placement=engine.placement), donate_argnums=(2, 3))
    text = (
        step.lower(
            engine.params,
            mtp,
            pool,
            mtp_pool,
            tables(4, 16),
            jnp.ones(4, jnp.int32),
            jnp.ones(4, jnp.int32),
            jnp.asarray([1, 2, 3, 1]),
        )
        .compile()
        .as_text()
    )
    assert any("index_k" in run for run in pool) and "index_k" in mtp_pool
    assert hlo.collectives(text)  # the steps' MoE exchanges
    moved = moved_pages(text, [pool, mtp_pool])
    assert not moved, moved


def test_forking_samples_under_dp_attention_moves_no_pages(dp_engine):
    pool = dp_engine.new_pool(16, PS)
    step = jax.jit(functools.partial(fork_slots, placement=dp_engine.placement), donate_argnums=0)
    pairs = jnp.asarray([1, 5, 16, 16], jnp.int32), jnp.asarray([2, 6, 16, 16], jnp.int32)  # pages on ranks 0 and 1
    text = (
        step.lower(
            pool,
            *pairs,
            jnp.zeros(dp_engine.c.vocab_size),
            sampling_rows([], 4, extras=True)[0],
            jnp.zeros(4, jnp.int32),
        )
        .compile()
        .as_text()
    )
    moved = moved_pages(text, pool)
    assert not moved, moved


# ---------------------------------------------------------------------------------- host side
def test_each_rank_hands_out_its_own_pages_and_usage_counts_every_rank():
    kv = KVPages(16, 4, 64, prefix_cache=True, ranks=4)
    got = [kv.take(3, rank) for rank in range(4)]
    assert got == [[0, 1, 2], [4, 5, 6], [8, 9, 10], [12, 13, 14]]
    assert kv.take(2, 1) is None and kv.usage == 12 / 16
    kv.release(got[1])
    assert kv.take(1, 1) == [7] and kv.available(1) == 3 and kv.usage == 10 / 16


def test_admission_takes_the_rank_whose_prefix_cache_holds_the_prompt():
    kv = KVPages(16, 4, 64, prefix_cache=True, ranks=4)
    seq = list(range(10, 19))  # two full pages and one more position
    rank, pages, keys, done, _ = kv.admit(seq, ranks=[2])
    kv.written(pages, keys, len(seq))
    kv.release(pages)
    got = kv.admit(seq, ranks=[0, 1, 2, 3])
    assert got[0] == 2 and got[1][:2] == pages[:2] and got[3] == 8
    assert kv.prefix.hits == 8 and kv.prefix.queries == 16


def test_admission_skips_a_rank_without_the_pages():
    kv = KVPages(8, 4, 64, prefix_cache=False, ranks=2)
    kv.take(3, 0)
    rank, pages, *_ = kv.admit(list(range(6)), ranks=[0, 1])  # 7 positions: 2 pages, rank 0 has 1
    assert rank == 1 and pages == [4, 5]
    assert kv.admit(list(range(6)), ranks=[0]) is None


# ---------------------------------------------------------------------------------- serving
PROMPTS = [
    [5, 17, 45, 2, 88, 61, 9, 30, 12],
    [7, 3],
    [40] * 13,
    [9, 8, 7, 6, 5],
    [60, 61, 62, 63, 64, 65, 66],
    [11, 12, 13],
    [90, 91, 92, 93, 94, 95],
]
NEW = 10


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of the contiguous single-device engine, one batch."""
    return engine_on(MODEL).generate(PROMPTS + [list(range(3, 24)), list(range(3, 19)) + [7, 8]], NEW).tokens


@pytest.fixture(scope="module")
def dp(dp_engine):
    """4 DP ranks of 2 slots, 6 pages of 4 positions each (fewer than two long requests want),
    prefill calls of 4 rows (one per rank)."""
    return Scheduler(dp_engine, slots=8, max_len=32, prefill_rows=4, page_size=4, kv_tokens=96)


def run(s, prompts, new=NEW, **kw):
    return s.run_all([Request(p, new, Stopper(None), **kw) for p in prompts])


def test_dp_ranks_serve_the_single_device_tokens_through_preemption(dp, reference):
    before = dp.preemptions
    assert [r.tokens for r in run(dp, PROMPTS)] == reference[: len(PROMPTS)]
    assert dp.preemptions > before and dp.kv.usage == 0 and dp.running == 0


def test_a_request_holds_only_its_ranks_pages(dp):
    seen = []
    r = Request(PROMPTS[0], NEW, Stopper(None))
    r.on_event = lambda *_: seen.extend(
        (s, dp.kv.rank_of(p)) for s, slot in enumerate(dp.slots) if slot is not None for p in slot.pages
    )
    dp.run_all([r])
    assert seen and all(rank == dp.rank(s) for s, rank in seen)


def test_a_prefix_cache_hit_on_a_rank_gives_the_same_tokens(dp, reference):
    first, second = list(range(3, 24)), list(range(3, 19)) + [7, 8]  # 4 pages of 4 in common
    run(dp, [first], 3)
    prefilled, hits = dp.prefilled_tokens, dp.kv.prefix.hits
    assert run(dp, [second], 5)[0].tokens == reference[-1][:5]  # 18 + 5 positions: within a rank's 24
    assert (dp.prefilled_tokens - prefilled, dp.kv.prefix.hits - hits) == (len(second) - 16, 16)


def test_n_samples_fork_on_their_prompts_rank_and_give_its_tokens(dp, reference):
    """9 positions and 4 new: each holds the 2 full pages and 2 of its own, on one rank's 6."""
    r = Request(PROMPTS[0], 4, Stopper(None), samples=[Request(PROMPTS[0], 4, Stopper(None))])
    preemptions = dp.preemptions
    dp.run_all([r])
    assert [s.tokens for s in [r, *r.samples]] == [reference[0][:4]] * 2
    assert dp.preemptions == preemptions and dp.kv.usage == 0


def test_more_samples_than_a_ranks_slots_are_refused_in_one_line(dp):
    r = Request(PROMPTS[0], 2, Stopper(None), samples=[Request(PROMPTS[0], 2, Stopper(None)) for _ in range(2)])
    with pytest.raises(UsageError, match="one of 4 DP ranks, which has 2 slots"):
        dp.check(r)


def test_prefill_and_decode_apart_over_other_rank_counts_is_refused(dp):
    prefill = engine_on(MODEL, dataclasses.replace(DP4, devices=2), chunk=8, first=4)
    with pytest.raises(UsageError, match="over 2 and 4 DP ranks"):
        Scheduler(dp.engine, slots=8, max_len=32, page_size=4, kv_tokens=96, prefill_engine=prefill)


def test_mtp_drafts_on_dp_ranks_give_the_single_device_tokens():
    """MLA and DSA pages and the MTP layer's pool on 4 ranks: plain greedy tokens, drafts or not."""
    one_layer = dataclasses.replace(preset("tiny-glm5"), num_layers=1, dense_layers=(), dsa_shared_layers=())
    engine = engine_on(one_layer, DP4, chunk=8)
    s = SpecScheduler(engine, load_mtp(engine.config, engine.placement), slots=4, max_len=32, page_size=4)
    prompts = PROMPTS[:5]
    assert [r.tokens for r in run(s, prompts, 8)] == engine_on(one_layer).generate(prompts, 8).tokens


# ---------------------------------------------------------------------------------- kernels, sizing
def test_auto_reads_pages_through_the_kernels_under_dp_on_accelerators_and_xla_on_cpu():
    config = Config(model=MODEL, layout=DP4).validate()
    assert make_placement(config, platform=resolve("tpu")).attention_kernel == "pallas_tpu"
    assert make_placement(config, platform=resolve("cpu")).attention_kernel == "xla"


def test_page_bytes_with_mtp_counts_the_mtp_layers_pool():
    c = preset("tiny-glm5")
    mtp = sum(a.nbytes for a in init_mtp_pool(c, 1, 16, jnp.float32).values())
    assert mtp > 0 and page_bytes(c, 16, jnp.float32, mtp=True) == page_bytes(c, 16, jnp.float32) + mtp


def test_plan_leaves_the_mtp_pool_its_share_of_each_devices_pages():
    config = Config(model=preset("tiny-glm5"), layout=DP4).validate()
    plain, mtp = (kv_pages(config, make_placement(config), 1e6, 16, 100, 20, mtp=m) for m in (False, True))
    c = config.model
    assert [m["page_bytes_per_device"] for m in (plain, mtp)] == [
        page_bytes(c, 16, jnp.float32, mtp=m) for m in (False, True)
    ]
    assert mtp["pages_per_device"] == int(1e6 // mtp["page_bytes_per_device"]) < plain["pages_per_device"]
