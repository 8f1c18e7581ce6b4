"""Continuous batching: requests among others give what they give alone, stop where they
should, free their slots, and nothing compiles after warm-up."""

from __future__ import annotations

import jax
import pytest
from text_model import make_text_model

from moejax.base import platform
from moejax.base.errors import UsageError
from moejax.config import Config, EngineConfig, LayoutConfig
from moejax.engine.engine import Engine
from moejax.engine.kv_cache import init_cache
from moejax.launch.loading import load_params, with_hf_model
from moejax.serving.scheduler import Request, Scheduler
from moejax.serving.stopping import Stopper
from moejax.serving.tokenizer import Tokenizer
from sharding import make_placement

PROMPTS = [[5, 17, 45, 2, 88, 61, 9, 30, 12], [7, 3], [40] * 13, [9, 8, 7, 6, 5], [60, 61, 62, 63, 64, 65, 66]]
LENGTHS = [6, 9, 3, 12, 5]


def build_engine(directory, prefill_chunk: int, layout: LayoutConfig = LayoutConfig(), first: int = 0) -> Engine:
    """On devices first .. first + layout.devices - 1."""
    config = with_hf_model(Config(engine=EngineConfig(prefill_chunk=prefill_chunk), layout=layout), str(directory))
    placement = make_placement(
        config.validate(), devices=jax.devices()[first : first + layout.devices] if layout.devices > 1 else None
    )
    return Engine(config, load_params(config, placement, hf_dir=str(directory)), placement)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("text_model"))


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = build_engine(model_dir, 4)
    engine.tokenizer = Tokenizer(model_dir)
    return engine


@pytest.fixture(scope="module")
def scheduler(engine):
    # Fewer slots than requests: later ones are admitted as earlier ones finish.
    s = Scheduler(engine, slots=3, max_len=64, prefill_rows=2)
    s.warm_up()
    return s


def request(prompt, n, stop_ids=(), stop_strings=(), tokenizer=None, **sampling):
    return Request(prompt, n, Stopper(tokenizer, stop_ids, stop_strings), **sampling)


def alone(scheduler, prompt, n, **kw):
    return scheduler.run_all([request(prompt, n, **kw)])[0]


def test_requests_among_others_equal_the_static_engine_alone(engine, scheduler):
    done = scheduler.run_all([request(p, n) for p, n in zip(PROMPTS, LENGTHS)])
    assert [r.tokens for r in done] == [engine.generate([p], n).tokens[0] for p, n in zip(PROMPTS, LENGTHS)]
    assert [r.finish_reason for r in done] == ["length"] * len(PROMPTS)
    assert scheduler.running == 0


# ragged_a2a runs in test_server.py (the server on 8 devices).
@pytest.mark.parametrize(
    "layout",
    [
        LayoutConfig(placement="tensor_sliced", devices=8),
        LayoutConfig(placement="hybrid", devices=8, ep=4, tp=2),
        LayoutConfig(placement="weight_prefetch", devices=8),
        LayoutConfig(placement="expert_sharded", devices=8, attention="tp"),
    ],
    ids=lambda layout: f"{layout.placement}-{layout.attention}",
)
def test_every_placement_batches_continuously_to_the_single_device_tokens(engine, model_dir, layout):
    s = Scheduler(build_engine(model_dir, 8, layout), slots=8, max_len=64)
    done = s.run_all([request(p, n) for p, n in zip(PROMPTS, LENGTHS)])
    assert [r.tokens for r in done] == [engine.generate([p], n).tokens[0] for p, n in zip(PROMPTS, LENGTHS)]


@pytest.fixture(scope="module")
def apart(model_dir):
    """Prefill chunks under ragged_a2a on devices 0-3, decode under weight_prefetch on 4-7."""
    s = Scheduler(
        build_engine(model_dir, 8, LayoutConfig(placement="weight_prefetch", devices=4), first=4),
        slots=4,
        max_len=64,
        prefill_engine=build_engine(model_dir, 8, LayoutConfig(placement="ragged_a2a", devices=4)),
    )
    s.warm_up()
    return s


def test_prefill_and_decode_apart_batch_continuously_to_the_single_device_tokens(engine, apart):
    done = apart.run_all([request(p, n) for p, n in zip(PROMPTS, LENGTHS)])
    assert [r.tokens for r in done] == [engine.generate([p], n).tokens[0] for p, n in zip(PROMPTS, LENGTHS)]


def test_prefill_apart_hands_over_the_positions_each_prefill_call_wrote(engine, apart):
    """A 9-token prompt in chunks of 8: each of the two calls moves the one 16-position page it
    wrote. A one-page move is not split over the 4 DP decode devices: each gets it whole."""
    before = apart.handover_bytes
    apart.run_all([request(PROMPTS[0], 6)])
    page = sum(a.nbytes for a in jax.tree.leaves(init_cache(engine.c, 1, apart.kv.page_size, engine.dtype)))
    assert apart.handover_bytes - before == 2 * 4 * page


def test_sampled_request_among_others_equals_it_alone(scheduler):
    kw = dict(temperature=1.0, top_p=0.9, seed=7)
    mixed = scheduler.run_all([request(PROMPTS[0], 8, **kw)] + [request(p, 5) for p in PROMPTS[1:]])[0]
    assert mixed.tokens == alone(scheduler, PROMPTS[0], 8, **kw).tokens


def test_stop_id_ends_the_request_early_with_stop(scheduler):
    full = alone(scheduler, PROMPTS[3], 12).tokens
    stop = full[4]
    r = alone(scheduler, PROMPTS[3], 12, stop_ids=[stop])
    assert r.tokens == full[: full.index(stop) + 1] and r.finish_reason == "stop"
    assert scheduler.running == 0


def test_stop_string_cuts_the_text_before_it(engine, scheduler):
    full = alone(scheduler, PROMPTS[0], 12, tokenizer=engine.tokenizer)
    stop = full.stopper.text[5:7]
    r = alone(scheduler, PROMPTS[0], 12, tokenizer=engine.tokenizer, stop_strings=[stop])
    assert r.stopper.text == full.stopper.text[: full.stopper.text.index(stop)] and r.finish_reason == "stop"


def test_full_cache_ends_the_request_by_length(scheduler):
    prompt = list(range(3, 3 + 60))
    r = alone(scheduler, prompt, 20)
    assert len(r.tokens) == scheduler.max_len - len(prompt) + 1 and r.finish_reason == "length"


def test_metrics_report_the_hand_over_bytes(apart):
    from prometheus_client import generate_latest

    from moejax.serving.metrics import Metrics

    metrics = Metrics(apart)
    apart.run_all([request(PROMPTS[1], 2)])
    assert f"moejax_handover_bytes {float(apart.handover_bytes)}" in generate_latest(metrics.registry).decode()
    assert apart.handover_bytes > 0


@pytest.fixture(params=["scheduler", "apart"])
def warm(request):
    """Each warmed-up scheduler: one engine, and prefill apart from decode."""
    return request.getfixturevalue(request.param)


def test_no_compile_after_warm_up(warm):
    programs = [warm._decode, warm._prefill] + ([warm._take, warm._put] if warm.apart else [])
    sizes = [f._cache_size() for f in programs]
    warm.run_all([request(PROMPTS[1], 4, temperature=0.5, top_k=5), request(list(range(3, 40)), 3)])
    assert [f._cache_size() for f in programs] == sizes


def test_bench_drives_an_in_process_scheduler(engine):
    from moejax.serving import bench

    client = bench.LocalClient(Scheduler(engine, slots=2, max_len=32))
    s = bench.run(
        client, num_prompts=5, input_len=6, output_len=4, request_rate=50.0, max_concurrency=None, progress=False
    )
    client.close()
    assert (s["completed"], s["total_output_tokens"]) == (5, 20) and s["request_throughput"] > 0


def test_cache_defaults_to_the_longest_request_it_will_hold(engine):
    """A server that knows its longest request (bench's own) allows requests of that length, in
    buckets of 16; one that does not, the model's context, at most 2048. The page pool is sized
    apart from both."""
    prompt, new = PROMPTS[0], 16 - len(PROMPTS[0])  # exactly a bucket: the last token needs no slot
    sized = Scheduler(engine, slots=2, longest=len(prompt) + new)
    assert sized.max_len == 16
    assert sized.run_all([request(prompt, new)])[0].tokens == engine.generate([prompt], new).tokens[0]
    default = Scheduler(engine, slots=2)
    assert default.max_len == min(engine.c.max_position_embeddings, 2048)
    assert (
        default.kv.num_pages * default.kv.page_size == platform.resolve("cpu").kv_cache_tokens
    )  # the pool: CPU's default


def test_cancelled_request_frees_its_slot_at_the_next_step(scheduler):
    r = request(PROMPTS[0], 30)
    r.on_event = lambda token, delta, done: setattr(r, "cancelled", len(r.tokens) >= 3)
    scheduler.run_all([r])
    assert len(r.tokens) == 3 and scheduler.running == 0


@pytest.fixture(scope="module")
def small(engine):
    """A pool of 12 pages of 4 positions: fewer than the requests running at once want."""
    return Scheduler(engine, slots=4, max_len=64, page_size=4, kv_tokens=48)


def test_pool_too_small_preempts_and_still_gives_every_requests_tokens(engine, small):
    before = small.preemptions
    done = small.run_all([request(p, 20) for p in PROMPTS])
    assert [r.tokens for r in done] == [engine.generate([p], 20).tokens[0] for p in PROMPTS]
    assert small.preemptions > before and small.kv.usage == 0


def test_prefix_cache_hit_gives_the_same_tokens_and_prefills_only_the_rest(engine, small):
    first = list(range(3, 24))
    second = first[:16] + [7, 8, 9, 10]  # the first 4 pages of 4 are the same
    small.run_all([request(first, 3)])
    prefilled, hits = small.prefilled_tokens, small.kv.prefix.hits
    r = small.run_all([request(second, 5)])[0]
    assert r.tokens == engine.generate([second], 5).tokens[0]
    assert (small.prefilled_tokens - prefilled, small.kv.prefix.hits - hits) == (len(second) - 16, 16)


@pytest.mark.parametrize("length", [9, 8], ids=["partial-last-page", "whole-pages"])
def test_n_samples_share_the_prompts_pages_and_give_its_tokens(engine, small, length):
    prompt = list(range(30 + length, 30 + 2 * length))  # its own: no prefix-cache hit
    r = request(prompt, 6, samples=[request(prompt, 6) for _ in range(2)])
    prefilled = small.prefilled_tokens
    small.run_all([r])
    assert [s.tokens for s in [r, *r.samples]] == [engine.generate([prompt], 6).tokens[0]] * 3
    assert small.prefilled_tokens - prefilled == length and small.kv.usage == 0


def test_prompt_that_can_never_fit_the_pool_is_refused_in_one_line(small):
    with pytest.raises(UsageError, match=r"the KV cache holds 12 \(--kv-cache-tokens\)"):
        small.check(request(list(range(3, 53)), 1))


def test_metrics_report_pages_preemptions_and_prefix_cache(small):
    from prometheus_client import generate_latest

    from moejax.serving.metrics import Metrics

    text = generate_latest(Metrics(small).registry).decode()
    for name, value in (
        ("moejax_kv_cache_usage", small.kv.usage),
        ("moejax_kv_pages_total", 12),
        ("moejax_preemptions", small.preemptions),
        ("moejax_prefix_cache_hits", small.kv.prefix.hits),
        ("moejax_prefix_cache_queries", small.kv.prefix.queries),
    ):
        assert f"{name} {float(value)}" in text


class Recorder:
    """A plan link that keeps each call as bytes, as the wire to a follower carries them."""

    def __init__(self):
        self.sent: list[bytes] = []

    def send(self, call) -> None:
        self.sent.append(call.to_bytes())


def test_a_follower_replaying_the_step_plan_ends_with_the_same_cache(engine):
    from moejax.serving.step_plan import Call

    leader, follower = (Scheduler(engine, slots=3, max_len=64, prefill_rows=2) for _ in range(2))
    leader.link = Recorder()
    leader.run_all([request(p, n, temperature=0.7, seed=i) for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))])
    for data in leader.link.sent:
        follower.execute(Call.from_bytes(data))
    assert {Call.from_bytes(d).name for d in leader.link.sent} == {"decode", "prefill"}
    assert all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(leader.cache), jax.tree.leaves(follower.cache)))
