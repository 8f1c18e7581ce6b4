"""Routing overrides (`--routing`): even draws uniformly, round_robin deals exactly evenly, and a
replayed trace comes back unchanged when the replayed run is recorded, under any placement."""

import contextlib
import io

import numpy as np
import pytest

from moejax.analysis import metrics
from moejax.analysis.trace import load_trace
from moejax.cli import main

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
