"""Sliding-window layers' own page group (gpt-oss): their own pools and block tables, whose pages
go back to the pool once every position of them fell out of the window. Served greedy tokens
equal the contiguous engine's while a request's window pages stay bounded and its full pages
grow; through a window pool short of the requests' pages (preemption), n samples, prefill apart,
DP ranks and a layer scan; and page bytes, pool sizing and `moejax plan` count both groups."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import pytest

from moejax.base.errors import UsageError
from moejax.base.platform import resolve
from moejax.compiled.plan import kv_pages
from moejax.config import Config, EngineConfig, LayoutConfig, preset
from moejax.engine.engine import Engine
from moejax.engine.kv_cache import init_pool, page_bytes
from moejax.engine.pages import pages_for
from moejax.launch.loading import load_mtp, load_params
from moejax.serving.kv_pages import pool_pages, window_held
from moejax.serving.request import Request
from moejax.serving.scheduler import Scheduler
from moejax.serving.speculative import SpecScheduler
from moejax.serving.stopping import Stopper
from sharding import make_placement

MODEL = preset("tiny-gpt-oss")  # window 4 on layers 0 and 2 of one run of 3
PS, CHUNK, NEW = 4, 8, 12
PROMPTS = [list(range(5, 30)), [7, 3], [40] * 13, [9, 8, 7, 6, 5, 4, 3]]
HELD = window_held(MODEL, PS, CHUNK, 64)  # (4 - 1 + 8) / 4 rounded up, + 1: 4 pages


def engine_on(layout=LayoutConfig(), layer_loop: str = "auto", first: int = 0) -> Engine:
    config = Config(
        model=MODEL, layout=layout, engine=EngineConfig(prefill_chunk=CHUNK, layer_loop=layer_loop)
    ).validate()
    devices = jax.devices()[first : first + layout.devices] if layout.devices > 1 else None
    placement = make_placement(config, devices=devices)
    return Engine(config, load_params(config, placement, seed=1), placement)


@pytest.fixture(scope="module")
def engine():
    return engine_on()


@pytest.fixture(scope="module")
def dp_engine():
    """4 DP ranks on devices 0-3."""
    return engine_on(LayoutConfig(placement="expert_sharded", devices=4, attention="dp"))


@pytest.fixture(scope="module")
def reference(engine):
    """Greedy tokens of the contiguous engine, one batch."""
    return engine.generate(PROMPTS, NEW).tokens


def serve(engine, **kw) -> Scheduler:
    return Scheduler(engine, slots=4, max_len=64, page_size=PS, kv_tokens=256, **kw)


@pytest.fixture(scope="module")
def served(engine):
    return serve(engine)


def run(s, prompts, new=NEW, **kw):
    return s.run_all([Request(p, new, Stopper(None), **kw) for p in prompts])


def held_pages(s) -> list[tuple[int, int]]:
    """(window pages, full pages) each running request holds now."""
    none = s.window_kv.num_pages
    return [(sum(p != none for p in slot.window), len(slot.pages)) for slot in s.slots if slot is not None]


def test_served_tokens_are_the_contiguous_engines_with_window_pages_freed(served, reference):
    seen = []
    requests = [Request(p, NEW, Stopper(None)) for p in PROMPTS]
    for r in requests:
        r.on_event = lambda *_: seen.extend(held_pages(served))
    served.run_all(requests)
    assert [r.tokens for r in requests] == reference
    longest = pages_for(len(PROMPTS[0]) + NEW - 1, PS)  # 36 positions written: 9 full pages
    assert max(w for w, _ in seen) <= HELD < max(f for _, f in seen) == longest
    assert served.window_kv.usage == 0 and served.kv.usage == 0


def test_the_window_pool_is_a_slots_share_and_the_prefix_cache_is_off(served):
    assert served.window_kv.num_pages == 4 * HELD < served.kv.num_pages
    assert served.kv.prefix is None and any("prefix cache is off" in n for n in served.notes)


def test_metrics_report_the_window_pool(served):
    from prometheus_client import generate_latest

    from moejax.serving.metrics import Metrics

    text = generate_latest(Metrics(served).registry).decode()
    assert f"moejax_kv_window_pages_total {float(served.window_kv.num_pages)}" in text
    assert "moejax_kv_window_cache_usage 0.0" in text


def test_a_window_pool_too_small_without_freeing_gives_the_ample_pools_tokens(engine, reference):
    """Two requests' windows for four slots, fewer pages than the longest request alone writes:
    requests wait or are preempted, none is lost."""
    small = serve(engine, window_pages=2 * HELD)
    assert pages_for(len(PROMPTS[0]) + NEW - 1, PS) > small.window_kv.num_pages
    assert [r.tokens for r in run(small, PROMPTS)] == reference
    assert small.preemptions > 0 and small.window_kv.usage == 0 and small.running == 0


def test_a_window_pool_short_of_one_requests_window_is_refused_in_one_line(engine):
    with pytest.raises(UsageError, match="hold less than one request's window"):
        serve(engine, window_pages=HELD - 1)


def test_n_samples_share_and_copy_window_pages(served, reference):
    """9 positions: the forks hold the prompt's window pages and copy its partly written last one."""
    prompt = PROMPTS[3] + [1, 2]
    r = Request(prompt, 6, Stopper(None), samples=[Request(prompt, 6, Stopper(None))])
    served.run_all([r])
    alone = run(served, [prompt], 6)[0].tokens
    assert [s.tokens for s in [r, *r.samples]] == [alone] * 2 and served.window_kv.usage == 0


def test_dp_ranks_hold_their_own_window_pages_and_give_the_same_tokens(dp_engine, reference):
    dp = Scheduler(dp_engine, slots=4, max_len=64, prefill_rows=4, page_size=PS, kv_tokens=256)
    seen = []
    requests = [Request(p, NEW, Stopper(None)) for p in PROMPTS]
    for r in requests:
        r.on_event = lambda *_: seen.extend(
            (dp.rank(s), dp.window_kv.rank_of(p))
            for s, slot in enumerate(dp.slots)
            if slot is not None
            for p in slot.window
            if p != dp.window_kv.num_pages
        )
    dp.run_all(requests)
    assert [r.tokens for r in requests] == reference
    assert seen and all(rank == page_rank for rank, page_rank in seen)


def test_prefill_apart_hands_over_both_groups(dp_engine, reference):
    """Prefill under TP attention on devices 4-5, decode on the 4 DP ranks."""
    prefill = engine_on(LayoutConfig(placement="expert_sharded", devices=2, attention="tp"), first=4)
    s = Scheduler(dp_engine, slots=4, max_len=64, prefill_rows=4, page_size=PS, kv_tokens=256, prefill_engine=prefill)
    assert [r.tokens for r in run(s, PROMPTS)] == reference and s.handover_bytes > 0


def test_a_layer_scan_over_mixed_layers_gives_the_same_tokens(reference):
    s = serve(engine_on(layer_loop="scan"))
    assert [r.tokens for r in run(s, PROMPTS)] == reference


def test_mtp_drafts_over_window_pages_give_the_plain_greedy_tokens(engine, reference):
    """A random MTP layer (a full-attention one): drafts accepted or not, the tokens are greedy's."""
    s = SpecScheduler(
        engine, load_mtp(engine.config, engine.placement), slots=4, max_len=64, page_size=PS, kv_tokens=256
    )
    assert [r.tokens for r in run(s, PROMPTS)] == reference and s.window_kv.usage == 0


# ---------------------------------------------------------------------------------- sizing
def test_page_bytes_split_into_the_two_groups():
    full, window = (page_bytes(MODEL, 16, jnp.float32, window=w) for w in (False, True))
    assert full + window == page_bytes(MODEL, 16, jnp.float32) and window == 2 * full  # 2 of 3 layers slide


def test_the_pool_holds_each_groups_layers_and_pages():
    (run_pool,) = init_pool(MODEL, 10, PS, jnp.float32, window_pages=3)
    assert {k: a.shape[:2] for k, a in run_pool.items()} == {
        "k": (1, 10),
        "v": (1, 10),
        "window_k": (2, 3),
        "window_v": (2, 3),
    }
    assert all(
        not k.startswith("window") for run in init_pool(preset("tiny-qwen3-moe"), 10, PS, jnp.float32) for k in run
    )


def test_kv_cache_gb_pays_for_the_window_pool_first():
    placement = types.SimpleNamespace(attention_kernel="xla", platform=resolve("cpu"))
    fake = types.SimpleNamespace(c=MODEL, dtype=jnp.float32, placement=placement)
    full, window = (page_bytes(MODEL, 16, jnp.float32, window=w) for w in (False, True))
    assert pool_pages(fake, 16, kv_gb=1e-3, window_pages=40) == int((1e6 - 40 * window) // full)
    assert pool_pages(fake, 16, kv_tokens=160, window_pages=40) == 10  # tokens count the full group's


def test_plan_counts_both_groups_per_request():
    config = Config(model=MODEL, layout=LayoutConfig(placement="expert_sharded", devices=4, attention="dp")).validate()
    kv = kv_pages(config, make_placement(config), 1e6, 16, 1000, 200)
    per_request = (
        kv["pages_per_request"] * kv["page_bytes_per_device"]
        + kv["window_pages_per_request"] * kv["window_page_bytes_per_device"]
    )
    assert kv["window_pages_per_request"] == window_held(MODEL, 16, 64, 1200) < kv["pages_per_request"] == 75
    assert kv["requests_per_rank"] == int(1e6 // per_request) > int(1e6 // (75 * page_bytes(MODEL, 16, jnp.float32)))
    assert kv["window_pages_per_device"] == kv["requests_per_rank"] * kv["window_pages_per_request"]


def test_a_model_without_window_layers_has_no_window_group():
    plain = dataclasses.replace(MODEL, sliding_layers=(), sliding_window=0)
    assert page_bytes(plain, 16, jnp.float32, window=False) == page_bytes(plain, 16, jnp.float32)
    assert page_bytes(plain, 16, jnp.float32, window=True) == 0
