"""Trace format, metrics, and `record --synthetic` + `analyze` against Row-Meets-Experts's GLM-5.3 figures.

Tolerances on the synthetic trace: Row-Meets-Experts rounds to two digits, and across generator seeds the
figures move by about 0.01 (which experts land together on a device is luck); the synthetic model
itself misses some figures by up to 0.02 (see moejax/analysis/synthetic.py). So: 0.02 on
balancedness, 0.03 on the touched fraction.
"""

import contextlib
import io
import json

import numpy as np
import pytest

from moejax.analysis import metrics, synthetic
from moejax.base.errors import UsageError
from moejax.base.trace import Trace, load_trace, save_trace
from moejax.cli import main
from sharding import eplb


@pytest.fixture(scope="module")
def glm_report(tmp_path_factory):
    """`record --synthetic glm-like` (300 steps of 64 rows) then `analyze --json --plots`, once."""
    tmp = tmp_path_factory.mktemp("glm")
    trace = tmp / "glm.npz"
    out = io.StringIO()  # capsys is function-scoped; a module fixture captures by hand
    with contextlib.redirect_stdout(out):
        assert main(["record", "--synthetic", "glm-like", "--out", str(trace)]) == 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["analyze", str(trace), "--json", "--plots", str(tmp / "plots")]) == 0
    return json.loads(out.getvalue())


def decode(report, n):
    return next(d for d in report["kinds"]["decode"]["devices"] if d["n"] == n)


def small_trace(**changes) -> dict:
    fields = dict(
        ids=np.array([[[[0, 1], [1, 2]]]]),
        valid=np.array([[True, True]]),
        kind=np.array(["decode"]),
        layers=np.array([1]),
        num_experts=4,
        model="hand",
    )
    fields.update(changes)
    return fields


# ----------------------------------------------------------------------------- trace format


def test_trace_round_trips_with_padding_and_kinds(tmp_path):
    ids = np.arange(2 * 1 * 3 * 2).reshape(2, 1, 3, 2) % 4
    valid = np.array([[True, True, False], [True, True, True]])
    save_trace(
        tmp_path / "t.npz", ids=ids, valid=valid, kind=["prefill", "decode"], layers=[3], num_experts=4, model="m"
    )
    t = load_trace(tmp_path / "t.npz")
    assert t.ids.dtype == np.int32 and t.k == 2 and t.num_experts == 4 and t.model == "m"
    assert t.kind.tolist() == ["prefill", "decode"] and t.layers.tolist() == [3]
    assert np.array_equal(t.step_ids(0), ids[0][:, :2])


def test_save_trace_rejects_expert_ids_out_of_range(tmp_path):
    with pytest.raises(UsageError, match="expert ids outside"):
        save_trace(tmp_path / "t.npz", **small_trace(ids=np.array([[[[0, 4], [1, 2]]]])))


def test_save_trace_ignores_ids_of_padding_rows(tmp_path):
    save_trace(tmp_path / "t.npz", **small_trace(ids=np.array([[[[0, 1], [-1, 99]]]]), valid=np.array([[True, False]])))
    assert load_trace(tmp_path / "t.npz").ids[0, 0, 1].tolist() == [0, 0]


def test_load_trace_rejects_a_file_that_is_not_a_trace(tmp_path):
    (tmp_path / "x.npz").write_bytes(b"not a zip")
    with pytest.raises(UsageError, match="is not a moejax trace"):
        load_trace(tmp_path / "x.npz")


# ----------------------------------------------------------------------------- metrics on hand cases


def test_counts_of_a_hand_worked_step():
    # 4 experts on 2 devices (0,1 | 2,3); row 0 (on device 0) picks 0,1; row 1 (on device 1) picks 1,2.
    t = Trace(**small_trace())
    c = metrics.placement_counts(t, eplb.contiguous(1, 4), 2)
    assert c.device_picks.tolist() == [[[3, 1]]]
    assert c.device_rows.tolist() == [[[2, 1]]]  # row 0 needs device 0; row 1 both
    assert c.device_experts.tolist() == [[[2, 1]]]  # device 0 reads experts 0 and 1
    assert c.copies.tolist() == [[1]]  # only row 1 leaves its device, to device 0
    assert metrics.balancedness(c.device_picks).tolist() == [[2 / 3]]


def test_picks_of_a_replicated_expert_are_dealt_round_robin():
    # Expert 0 on slots 0 and 2 (devices 0 and 1): its 4 picks go to slots 0, 2, 0, 2.
    slots = metrics.pick_slots(np.zeros((1, 4, 1), dtype=np.int32), *eplb.logical_maps(np.array([[0, 1, 0, 1]]), 2))
    assert slots[0, :, 0].tolist() == [0, 2, 0, 2]


def test_rows_start_on_devices_in_contiguous_blocks():
    assert metrics.own_devices(8, 4).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_busiest_expert_against_mean_over_all_steps():
    counts = np.array([[[4, 0, 0, 0]], [[2, 2, 0, 0]]])  # [S=2, L=1, E=4]: totals 6, 2, 0, 0 -> mean 2
    assert metrics.busiest_expert_vs_mean(counts).tolist() == [3.0]


# ----------------------------------------------------------------------------- synthetic generator


def test_synthetic_trace_is_deterministic_per_seed():
    a = synthetic.generate(synthetic.GLM_LIKE, steps=2, rows=4, seed=0)["ids"]
    assert np.array_equal(a, synthetic.generate(synthetic.GLM_LIKE, steps=2, rows=4, seed=0)["ids"])
    assert not np.array_equal(a, synthetic.generate(synthetic.GLM_LIKE, steps=2, rows=4, seed=1)["ids"])


def test_synthetic_rows_pick_k_distinct_experts():
    ids = synthetic.generate(synthetic.GLM_LIKE, steps=1, rows=4, seed=0)["ids"]
    assert all(len(set(row)) == 8 for row in ids.reshape(-1, 8).tolist())


# ----------------------------------------------------------------------------- Row-Meets-Experts's figures


def test_glm_like_touches_about_72_percent_per_step(glm_report):
    touched = glm_report["kinds"]["decode"]["experts_touched"]
    assert touched["trace"] == pytest.approx(0.72, abs=0.03)
    assert round(touched["even"], 2) == 0.87


def test_glm_like_busiest_expert_is_2_9_to_14_times_the_mean(glm_report):
    ratio = glm_report["kinds"]["decode"]["busiest_expert_vs_mean"]
    assert ratio["min"] == pytest.approx(2.9, abs=0.3) and ratio["max"] == pytest.approx(14, abs=1)


@pytest.mark.parametrize("n, expected", [(8, 0.75), (16, 0.61), (32, 0.46)])
def test_glm_like_contiguous_balancedness(glm_report, n, expected):  # sections 5.4 and 7
    assert decode(glm_report, n)["contiguous"]["balancedness"] == pytest.approx(expected, abs=0.02)


@pytest.mark.parametrize("n, expected", [(8, 0.86), (16, 0.78), (32, 0.67)])
def test_glm_like_eplb_with_32_spare_slots(glm_report, n, expected):  # sections 5.4 and 7
    assert decode(glm_report, n)["eplb_test"]["balancedness"] == pytest.approx(expected, abs=0.02)


@pytest.mark.parametrize("n", [8, 16, 32])
def test_eplb_reaches_the_even_router(glm_report, n):  # "slightly exceeds an even router"
    d = decode(glm_report, n)
    assert d["eplb_test"]["balancedness"] >= d["even"]["balancedness"] - 0.005


def test_eplb_adds_bytes_and_bytes_variant_lowers_busiest_bytes(glm_report):  # section 5.4
    d = decode(glm_report, 8)
    assert d["eplb_test"]["busiest_device_expert_bytes"] > d["contiguous_test"]["busiest_device_expert_bytes"]
    assert d["eplb_bytes_test"]["busiest_device_expert_bytes"] < d["contiguous_test"]["busiest_device_expert_bytes"]


def test_glm_like_rows_send_4_6_copies_on_8_devices(glm_report):  # section 4.3: as the even router
    assert round(decode(glm_report, 8)["contiguous"]["copies_per_row"], 1) == 4.6


def test_analyze_json_shape(glm_report):
    assert set(glm_report) == {"trace", "geometry", "eplb", "kinds", "plots"}
    kind = glm_report["kinds"]["decode"]
    assert (kind["steps"], kind["fit_steps"], kind["test_steps"]) == (300, 180, 120)
    assert len(kind["per_layer"]["layer"]) == 75 and set(kind["per_layer"]["balancedness"]) == {"8", "16", "32"}
    assert set(decode(glm_report, 8)) == {"n", "even", "contiguous", "contiguous_test", "eplb_test", "eplb_bytes_test"}
    assert len(kind["example"]["expert_picks"]) == 256 and len(kind["example"]["device_picks"]) == 8


def test_analyze_writes_png_plots(glm_report):
    assert len(glm_report["plots"]) == 2
    for path in glm_report["plots"]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_analyze_reports_prefill_and_decode_apart(tmp_path, capsys):
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permuted(np.broadcast_to(np.arange(16), (2, 6, 16)), axis=-1)[..., :4] for _ in range(5)])
    valid = np.ones((5, 6), dtype=bool)
    valid[1:, 4:] = False  # decode steps hold 4 rows, the prefill step 6
    save_trace(
        tmp_path / "t.npz",
        ids=ids,
        valid=valid,
        kind=["prefill"] + ["decode"] * 4,
        layers=[1, 2],
        num_experts=16,
        model="tiny",
    )
    assert (
        main(
            ["analyze", str(tmp_path / "t.npz"), "--preset", "tiny", "--devices", "2,4", "--eplb-slots", "4", "--json"]
        )
        == 0
    )
    kinds = json.loads(capsys.readouterr().out)["kinds"]
    assert kinds["prefill"]["rows_per_step"] == 6 and "eplb_test" not in kinds["prefill"]["devices"][0]
    assert kinds["decode"]["rows_per_step"] == 4 and kinds["decode"]["test_steps"] == 1


def test_analyze_rejects_devices_that_do_not_divide_the_experts(tmp_path, capsys):
    save_trace(tmp_path / "t.npz", **small_trace(num_experts=16))
    assert main(["analyze", str(tmp_path / "t.npz"), "--preset", "tiny", "--devices", "3"]) == 2
    assert "3 devices do not divide 16 experts" in capsys.readouterr().err


def test_record_requires_a_source(capsys):
    with pytest.raises(SystemExit):
        main(["record", "--out", "x.npz"])
