"""`moejax record` from a model run: trace shape, the valid mask, and picks that are the router's
own (the same across runs and across placements)."""

import contextlib
import io

import numpy as np
import pytest

from moejax.base.trace import load_trace
from moejax.cli import main
from moejax.engine.routing import valid_rows

PROMPTS = ["1,2,3", "4,5,6,7,8"]


def record(path, *extra) -> object:
    argv = ["record", "--preset", "tiny", "--steps", "3", "--out", str(path)]
    for p in PROMPTS:
        argv += ["--prompt-ids", p]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv + list(extra)) == 0
    return load_trace(path)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return record(tmp_path_factory.mktemp("rec") / "single.npz")


def test_valid_rows_mark_batch_padding_and_positions_past_each_prompt():
    # Two requests of 3 and 1 tokens in a batch of 4, prefill chunks of 2 positions: (request, position) order.
    assert valid_rows([3, 1], 4, 2, 0).tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert valid_rows([3, 1], 4, 2, 2).tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert valid_rows([3, 1], 4, 2, None).tolist() == [1, 1, 0, 0]


def test_recorded_trace_shape_and_valid_mask(single):
    # tiny: 3 layers, layer 0 dense, 16 experts top-4; one prefill chunk of 16 positions (the
    # prompts' bucket) x 2 requests.
    assert single.ids.shape == (4, 2, 32, 4)
    assert single.kind.tolist() == ["prefill", "decode", "decode", "decode"]
    assert single.layers.tolist() == [1, 2] and single.num_experts == 16 and single.model == "tiny"
    assert single.valid.sum(axis=1).tolist() == [3 + 5, 2, 2, 2]
    assert single.valid[0, [0, 1, 2, 16, 20]].all() and not single.valid[0, [3, 21]].any()
    for s in range(single.num_steps):  # a row's picks are distinct experts
        picks = single.step_ids(s)
        assert (np.sort(picks, axis=-1)[..., 1:] != np.sort(picks, axis=-1)[..., :-1]).all()


def test_recording_is_deterministic(single, tmp_path):
    again = record(tmp_path / "again.npz")
    assert np.array_equal(again.ids, single.ids) and np.array_equal(again.valid, single.valid)


def test_picks_are_the_same_under_a_placement_on_the_mesh(single, tmp_path):
    meshed = record(tmp_path / "mesh.npz", "--devices", "8", "--placement", "expert_sharded")
    assert meshed.kind.tolist() == single.kind.tolist()
    for s in range(single.num_steps):  # the mesh pads the batch to 8 requests; the real rows agree
        assert np.array_equal(meshed.step_ids(s), single.step_ids(s))


def test_synthetic_and_model_sources_are_exclusive(tmp_path, capsys):
    assert main(["record", "--synthetic", "glm-like", "--preset", "tiny", "--out", str(tmp_path / "x.npz")]) == 2
    assert "--synthetic" in capsys.readouterr().err
