"""Routing overrides (`--routing`): even draws uniformly, round_robin deals exactly evenly, and a
replayed trace comes back unchanged when the replayed run is recorded, under any placement."""

import contextlib
import dataclasses
import io

import numpy as np
import pytest

from moejax.analysis import metrics
from moejax.base.trace import load_trace
from moejax.cli import main
from moejax.config import from_dict, replace_checked
from moejax.launch.factory import build_engine
from moejax.serving.scheduler import Request, Scheduler
from moejax.serving.stopping import Stopper

PROMPTS = ["1,2,3", "4,5,6,7,8"]


def record(path, steps, *extra):
    argv = ["record", "--preset", "tiny", "--steps", str(steps), "--out", str(path)]
    for p in PROMPTS:
        argv += ["--prompt-ids", p]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv + list(extra)) == 0
    return load_trace(path)


def real_counts(trace):
    """int[L, E]: picks per expert over the trace's real rows."""
    return metrics.expert_counts(trace).sum(axis=0)


@pytest.fixture(scope="module")
def even(tmp_path_factory):
    path = tmp_path_factory.mktemp("routing") / "even.npz"
    return path, record(path, 31, "--routing", "even")


def test_even_counts_are_uniform_within_sampling_error(even):
    counts = real_counts(even[1])  # 8 prompt rows + 31 x 2 decode rows, 4 picks each, 16 experts
    expected = counts.sum(axis=1, keepdims=True) / counts.shape[1]
    chi2 = ((counts - expected) ** 2 / expected).sum(axis=1)
    assert (chi2 < 37.7).all(), chi2  # chi-square, 15 degrees of freedom: p = 0.001


def test_round_robin_counts_are_exactly_equal(tmp_path):
    # (8 + 30 x 2) rows x 4 picks = 17 x 16 (30 steps: the KV cache bucket, so the program, of `even`)
    trace = record(tmp_path / "rr.npz", 30, "--routing", "round_robin")
    counts = real_counts(trace)
    assert (counts == 17).all()


# One device (the program `even` compiled) and a mesh whose exchange sends each row only to its
# picks' devices. A trace of even picks, not the router's: replay that did not force would fail.
@pytest.mark.parametrize("layout", [(), ("--devices", "8", "--placement", "ragged_a2a")], ids=["single", "ragged_a2a"])
def test_replayed_trace_records_identical_under_a_placement(even, layout, tmp_path):
    path, original = even
    again = record(tmp_path / "again.npz", 31, "--routing", f"replay:{path}", *layout)
    assert again.kind.tolist() == original.kind.tolist()
    for s in range(original.num_steps):  # the mesh pads the batch to 8 requests; the real rows are the trace's
        assert np.array_equal(again.step_ids(s), original.step_ids(s))


def test_replay_of_another_models_trace_is_one_clear_error(even, capsys):
    argv = ["generate", "--preset", "tiny-qwen3-moe", "--prompt-ids", "1,2,3", "--routing", f"replay:{even[0]}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "replay: the trace has top-4 of 16 experts on MoE layers [1, 2]" in err


@pytest.mark.parametrize("routing", ["uniform", "replay", "round_robin:2", "even:x"])
def test_a_routing_that_is_no_mode_is_one_clear_error(routing, capsys):
    assert main(["generate", "--preset", "tiny", "--routing", routing]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"engine.routing {routing!r} is not one of natural, even[:SEED]" in err


@pytest.fixture(scope="module")
def serving():
    """A continuous-batching scheduler on tiny under round_robin, warmed up, and the picks of its calls."""
    config = from_dict({}, preset_name="tiny")
    config = dataclasses.replace(config, engine=replace_checked(config.engine, {"routing": "round_robin"}, "engine."))
    scheduler = Scheduler(build_engine(config, None, 0), slots=1, max_len=32)
    scheduler.warm_up()
    seen = []
    scheduler.pick_observers.append(lambda kind, ids, valid: seen.append(ids[:, valid]))  # [L, real rows, k]
    return scheduler, seen


def request(prompt, n, **sampling):
    return Request(prompt, n, Stopper(None, (), ()), **sampling)


def test_serving_deals_round_robin_over_the_real_rows(serving):
    scheduler, seen = serving
    scheduler.run_all([request([1, 2, 3], 6), request([4, 5], 6)])  # 5 prompt rows and 2 x 5 decode rows
    picks = np.concatenate(seen, axis=1)  # [L, rows, k]
    counts = np.stack([np.bincount(layer.reshape(-1), minlength=16) for layer in picks])
    assert picks.shape[1] == 3 + 2 + 2 * 5 and (counts.max(axis=1) - counts.min(axis=1) <= 1).all()


def test_serving_with_an_override_compiles_nothing_after_warm_up(serving):
    scheduler, _ = serving
    sizes = scheduler._decode._cache_size(), scheduler._prefill._cache_size()
    scheduler.run_all([request([7, 8], 3, temperature=0.5)])
    assert (scheduler._decode._cache_size(), scheduler._prefill._cache_size()) == sizes
