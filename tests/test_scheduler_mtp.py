"""Continuous batching with MTP drafts: greedy tokens equal plain greedy decoding, alone or among
others, and a draft that mirrors the target is mostly accepted."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moejax.base.errors import UsageError
from moejax.config import Config, EngineConfig, preset
from moejax.engine.engine import Engine
from moejax.launch.loading import load_params
from moejax.model.mtp import mirrored_draft
from moejax.serving.scheduler import Request, Scheduler
from moejax.serving.speculative import SpecScheduler
from moejax.serving.stopping import Stopper
from sharding import make_placement

RNG = np.random.RandomState(0)
PROMPTS = [RNG.randint(0, 512, n).tolist() for n in (40, 23, 5, 17, 9)]
LENGTHS = [12, 7, 16, 3, 10]
ONE_LAYER = dataclasses.replace(preset("tiny-glm5"), num_layers=1, dense_layers=(), dsa_shared_layers=())


@pytest.fixture(scope="module")
def spec():
    config = Config(model=ONE_LAYER, engine=EngineConfig(prefill_chunk=16)).validate()
    placement = make_placement(config)
    params, mtp = mirrored_draft(load_params(config, placement), config.model)
    s = SpecScheduler(Engine(config, params, placement), mtp, slots=3, max_len=64)
    s.warm_up()
    return s


def test_mtp_among_others_gives_plain_greedy_tokens_and_accepts_mirrored_drafts(spec):
    done = spec.run_all([Request(p, n, Stopper(None)) for p, n in zip(PROMPTS, LENGTHS)])
    assert [r.tokens for r in done] == [spec.engine.generate([p], n).tokens[0] for p, n in zip(PROMPTS, LENGTHS)]
    assert spec.accepted / spec.drafts > 0.5 and spec.running == 0


def test_mtp_stop_id_ends_a_request_between_its_two_tokens(spec):
    full = spec.run_all([Request(PROMPTS[2], 16, Stopper(None))])[0].tokens
    r = spec.run_all([Request(PROMPTS[2], 16, Stopper(None, stop_ids=[full[6]]))])[0]
    assert r.tokens == full[: full.index(full[6]) + 1] and r.finish_reason == "stop"


def test_mtp_scheduler_refuses_sampled_requests(spec):
    with pytest.raises(UsageError, match="greedy"):
        spec.check(Request(PROMPTS[0], 4, Stopper(None), temperature=0.7))


def test_paged_scheduler_on_mla_gives_the_static_engines_tokens(spec):
    """MLA latent, rope key and DSA indexer keys in pages of 4 (no MTP): the plain greedy tokens."""
    s = Scheduler(spec.engine, slots=3, max_len=64, page_size=4, kv_tokens=96)
    done = s.run_all([Request(p, n, Stopper(None)) for p, n in zip(PROMPTS, LENGTHS)])
    assert [r.tokens for r in done] == [spec.engine.generate([p], n).tokens[0] for p, n in zip(PROMPTS, LENGTHS)]
