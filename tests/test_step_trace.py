"""`moejax trace`: per device and MoE layer times read back from the profiler, Decode-Anatomy's imbalance
term, and that term growing when every pick lands on one device's experts."""

import contextlib
import io
import json

import numpy as np
import pytest

from moejax.analysis import step_trace
from moejax.base.trace import save_trace
from moejax.cli import main
from moejax.engine.routing import valid_rows

STEPS = 5
PROMPTS = ["1"] * 8  # one request per device (DP attention); decode steps of 8 rows


def trace(routing, *extra):
    argv = [
        "trace",
        "--preset",
        "tiny",
        "--devices",
        "8",
        "--placement",
        "expert_sharded",
        "--steps",
        str(STEPS),
        "--routing",
        routing,
        "--json",
        *extra,
    ]
    for p in PROMPTS:
        argv += ["--prompt-ids", p]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def even(tmp_path_factory):
    png = tmp_path_factory.mktemp("trace") / "experts.png"
    return trace("even", "--plot", str(png)), png


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    """A replay of a synthetic trace whose every pick is expert 0 or 1: device 0's, under
    expert_sharded's contiguous 2 experts per device. One prefill and STEPS decode passes per run,
    for the warm-up run and the traced one."""
    path = tmp_path_factory.mktemp("trace") / "skewed.npz"
    passes = 1 + STEPS
    valid = [valid_rows([1] * 8, 8, 16, 0)] + [np.pad(valid_rows([1] * 8, 8, 1, None), (0, 120))] * STEPS
    save_trace(
        path,
        np.tile([0, 1, 0, 1], (passes, 2, 128, 1)),
        valid,
        ["prefill"] + ["decode"] * STEPS,
        [1, 2],
        16,
        "every pick on device 0's experts",
    )
    return trace(f"replay:{path}")


def test_a_row_per_device_per_moe_layer(even):
    doc = even[0]
    assert [entry["layer"] for entry in doc["layers"]] == [1, 2]
    for entry in doc["layers"]:
        assert [d["device"] for d in entry["devices"]] == list(range(8))
        assert set(entry["devices"][0]) == {"device", "attention_ms", "dispatch_ms", "experts_ms", "combine_ms"}


def test_times_are_positive_and_sum_to_no_more_than_the_step(even):
    doc = even[0]
    parts = np.array([[[d[f"{p}_ms"] for p in step_trace.PARTS] for d in entry["devices"]] for entry in doc["layers"]])
    assert (parts > 0).all()
    assert (parts.sum(axis=(0, 2)) <= doc["step_ms"]).all()  # per device, over layers and parts
    for entry in doc["layers"]:
        experts = [d["experts_ms"] for d in entry["devices"]]
        assert entry["slowest_ms"] == max(experts) and entry["slowest_device"] == int(np.argmax(experts))
        assert entry["imbalance_ms"] == pytest.approx(max(experts) - np.mean(experts))


def test_heat_map_is_written(even):
    assert even[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_imbalance_grows_when_every_pick_is_on_device_0(even, skewed):
    experts = lambda doc: np.array([[d["experts_ms"] for d in entry["devices"]] for entry in doc["layers"]])
    assert experts(skewed).sum(axis=0).argmax() == 0  # over the layers, device 0 computes longest
    assert skewed["imbalance_ms"] > 2 * even[0]["imbalance_ms"]


def test_events_belong_to_the_layer_window_they_start_in():
    # Two layers; "attn" runs once per layer and opens each window; a nested loop's "gemm" runs 3
    # times in layer 0 and once in layer 1; "xch" before the gemms is dispatch, after them combine.
    scopes = {
        "attn": "f/moe_layers/attention/dot",
        "gemm": "f/moe_layers/moe/shard_map/experts/dot",
        "xch": "f/moe_layers/moe/shard_map/all_gather",
        "norm": "f/moe_layers/rsqrt",
    }
    ms = 1_000_000
    events = [
        (7, 0, op, a * ms, b * ms)
        for op, a, b in [
            ("attn", 0, 1),
            ("xch", 1, 2),
            ("gemm", 2, 3),
            ("gemm", 3, 4),
            ("gemm", 4, 5),
            ("xch", 5, 7),
            ("norm", 7, 8),
            ("attn", 10, 12),
            ("xch", 12, 13),
            ("gemm", 13, 17),
            ("xch", 17, 18),
        ]
    ]
    parts, steps = step_trace.attribute(events, scopes, layers=2, devices=1)
    assert parts[0, 0].tolist() == [[1, 1, 3, 2], [2, 1, 4, 1]]  # attention, dispatch, experts, combine
    assert steps.tolist() == [18]
