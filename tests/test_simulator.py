"""The placement simulator on hand-made traces and a hand-made cost table (no timing): per-device
work per placement, skew moving the slowest device, and `moejax advise --json`."""

import dataclasses
import json

import numpy as np
import pytest

from moejax.analysis import costs
from moejax.analysis.simulate import device_work, layouts, phase_us, simulate
from moejax.base.trace import Trace, save_trace
from moejax.cli import main
from moejax.config import Config, preset
from sharding import eplb

N, E, K, ROWS = 8, 32, 4, 8  # 8 devices, 32 experts top-4 (4 per device), one 8-row decode step


def hand_table(num_experts=E, model="hand") -> costs.CostTable:
    """Call cost proportional to the weights read and the routes run at that width; fixed exchanges."""
    held = num_experts // N
    compute = {}
    for rows, width, h in ((ROWS, 256, held), (ROWS, 128, 2 * held), (ROWS, 32, num_experts), (1, 256, num_experts)):
        compute[f"{rows},{width},{h}"] = [5.0, width / 64, width / 16]  # base, per route, per expert (us)
    exchange = {f"{l.name},{l.ep},{l.tp},{ROWS}": 10.0 * (l.devices - 1) for l in layouts(N)}
    return costs.CostTable(model, 256, 1 << 20, compute, exchange, {f"{N},{ROWS}": 1000.0})


def trace_of(picks, num_experts=E, steps=1) -> Trace:
    ids = np.broadcast_to(np.asarray(picks, np.int32), (steps, 1, ROWS, K)).copy()
    return Trace(
        ids, np.ones((steps, ROWS), bool), np.array(["decode"] * steps), np.array([1], np.int32), num_experts, "hand"
    )


SKEWED = trace_of([[0, 1, 2, 3]] * ROWS)  # every pick on device 0
SPREAD = trace_of([[0, 4, 8, 12]] * ROWS)  # the same 4 experts' worth of picks over devices 0-3
CONTIGUOUS = eplb.contiguous(1, E)
BY_NAME = {l.name: l for l in layouts(N)}


def test_device_work_per_placement():
    es = device_work(SKEWED, BY_NAME["expert_sharded"], CONTIGUOUS, 256)
    assert es.routes[0, 0].tolist() == [32, 0, 0, 0, 0, 0, 0, 0] and es.width == 256 and es.held == 4
    hy = device_work(SPREAD, BY_NAME["hybrid"], CONTIGUOUS, 256)  # 4 groups of 8 experts, 2 slices each
    assert hy.routes[0, 0].tolist() == [16, 16, 16, 16, 0, 0, 0, 0] and hy.width == 128 and hy.held == 8
    ts = device_work(SKEWED, BY_NAME["tensor_sliced"], CONTIGUOUS, 256)
    assert ts.routes[0, 0].tolist() == [32] * 8 and ts.experts[0, 0].tolist() == [4] * 8 and ts.width == 32
    wp = device_work(SPREAD, BY_NAME["weight_prefetch"], CONTIGUOUS, 256)  # one own row each, all experts
    assert wp.rows.tolist() == [1] and wp.routes[0, 0].tolist() == [4] * 8 and wp.held == E


def test_skew_makes_expert_sharded_the_slowest_and_leaves_tensor_sliced_alone():
    table = hand_table()
    skewed = {l.name: simulate(SKEWED, l, CONTIGUOUS, table) for l in layouts(N)}
    spread = {l.name: simulate(SPREAD, l, CONTIGUOUS, table) for l in layouts(N)}
    slowest = skewed["expert_sharded"]["expert_ms"]
    assert slowest == skewed["ragged_a2a"]["expert_ms"]  # the same experts per device, the same picks
    assert all(slowest > skewed[name]["expert_ms"] for name in ("tensor_sliced", "hybrid", "weight_prefetch"))
    assert skewed["expert_sharded"]["expert_ms"] > spread["expert_sharded"]["expert_ms"]
    assert skewed["expert_sharded"]["busiest_device_routes"] == 32 == 8 * skewed["expert_sharded"]["mean_device_routes"]
    assert skewed["tensor_sliced"] == spread["tensor_sliced"]
    # step = non-MoE + layers x (exchange + slowest device); expert_sharded skewed: 5 + 32*4 + 4*16 us.
    assert skewed["expert_sharded"]["step_ms"] == pytest.approx((1000 + 70 + 5 + 32 * 4 + 4 * 16) / 1e3)


def test_eplb_order_spreads_a_hot_device():
    # Experts 0-3 hot, every row picks them: a placement fitted on these counts puts them on four devices.
    weight = np.zeros((1, E))
    weight[0, :4] = 8
    fitted, _, _ = eplb.rebalance_experts(weight, E, 1, 1, N)
    table = hand_table()
    es = BY_NAME["expert_sharded"]
    assert simulate(SKEWED, es, fitted, table)["expert_ms"] < simulate(SKEWED, es, CONTIGUOUS, table)["expert_ms"]


def test_phase_is_the_slowest_device_or_the_queue_of_too_few_cores():
    calls = np.array([[[4.0, 1.0, 1.0, 2.0]]])
    assert phase_us(calls, 1 << 20)[0, 0] == 4.0
    assert phase_us(calls, 1)[0, 0] == 8.0  # one core runs the devices one after the other


def test_advise_json(tmp_path, capsys):
    tiny = dataclasses.replace(Config(), model=preset("tiny"))  # 16 experts top-4
    table = hand_table(16, costs.geometry_key(tiny))
    costs.save(table, tmp_path / "costs.json")
    rng = np.random.default_rng(0)
    ids = np.stack([[rng.choice(16, K, replace=False) for _ in range(ROWS)] for _ in range(10)])[:, None]
    save_trace(
        tmp_path / "t.npz",
        ids=ids,
        valid=np.ones((10, ROWS), bool),
        kind=["decode"] * 10,
        layers=[1],
        num_experts=16,
        model="tiny",
    )
    assert (
        main(
            [
                "advise",
                str(tmp_path / "t.npz"),
                "--preset",
                "tiny",
                "--devices",
                "8",
                "--costs",
                str(tmp_path / "costs.json"),
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["devices"] == 8 and report["steps"] == 10 and (report["fit_steps"], report["test_steps"]) == (6, 4)
    assert sorted(report["ranking"]) == sorted(l.name for l in layouts(N))
    assert [p["placement"] for p in report["placements"]] == report["ranking"]
    moe = [p["contiguous"]["moe_ms"] for p in report["placements"]]
    assert moe == sorted(moe)
    for p in report["placements"]:
        assert set(p["contiguous"]) >= {"step_ms", "moe_ms", "expert_ms", "exchange_ms", "busiest_device_routes"}
        assert ("eplb_test" in p) == (p["placement"] in ("expert_sharded", "hybrid", "ragged_a2a"))


def test_advise_rejects_a_trace_of_another_model(tmp_path, capsys):
    save_trace(
        tmp_path / "t.npz",
        ids=np.zeros((1, 1, 2, 2)),
        valid=np.ones((1, 2), bool),
        kind=["decode"],
        layers=[1],
        num_experts=6,
        model="x",
    )
    assert main(["advise", str(tmp_path / "t.npz"), "--preset", "tiny", "--costs", str(tmp_path / "c.json")]) == 2
    assert "6 experts" in capsys.readouterr().err


LAYER = {
    "layer": 1,
    "slowest_ms": 2.0,
    "devices": [
        {"device": 0, "attention_ms": 9.0, "dispatch_ms": 1.0, "experts_ms": 2.0, "combine_ms": 1.0},
        {"device": 1, "attention_ms": 1.0, "dispatch_ms": 3.0, "experts_ms": 0.5, "combine_ms": 1.0},
    ],
}
TRACED = {
    "placement": "expert_sharded",
    "ep": 8,
    "tp": 1,
    "devices": 8,
    "routing": "replay:t.npz",
    "steps": 3,
    "step_ms": 12.5,
    "imbalance_ms": 1.25,
    "layers": [LAYER, LAYER],
}


def advise_with_step_trace(tmp_path, traced: dict) -> list[str]:
    """advise's argv on a 3-step trace of every pick on device 0, with `traced` as the step trace."""
    tiny = dataclasses.replace(Config(), model=preset("tiny"))
    costs.save(hand_table(16, costs.geometry_key(tiny)), tmp_path / "costs.json")
    save_trace(
        tmp_path / "t.npz",
        ids=np.tile(np.arange(K), (3, 1, ROWS, 1)),
        valid=np.ones((3, ROWS), bool),
        kind=["decode"] * 3,
        layers=[1],
        num_experts=16,
        model="tiny",
    )
    (tmp_path / "st.json").write_text(json.dumps(traced))
    return [
        "advise",
        str(tmp_path / "t.npz"),
        "--preset",
        "tiny",
        "--devices",
        "8",
        "--costs",
        str(tmp_path / "costs.json"),
        "--step-trace",
        str(tmp_path / "st.json"),
    ]


def test_advise_puts_a_traced_step_beside_the_simulated_one(tmp_path, capsys):
    assert main(advise_with_step_trace(tmp_path, TRACED) + ["--json"]) == 0
    rows = {p["placement"]: p for p in json.loads(capsys.readouterr().out)["placements"]}
    assert rows["expert_sharded"]["measured"] == {
        "step_ms": 12.5,
        "moe_ms": 9.0,
        "expert_ms": 4.0,
        "imbalance_ms": 1.25,
        "steps": 3,
        "routing": "replay:t.npz",
    }
    assert [name for name, p in rows.items() if "measured" in p] == ["expert_sharded"]
    simulated = rows["expert_sharded"]["contiguous"]  # every pick on device 0: the slowest minus the mean device
    assert simulated["imbalance_ms"] == pytest.approx(simulated["expert_ms"] - simulated["mean_device_expert_ms"])
    assert simulated["imbalance_ms"] > 0


def test_advise_rejects_a_step_trace_of_another_mesh(tmp_path, capsys):
    assert main(advise_with_step_trace(tmp_path, {**TRACED, "devices": 4})) == 2
    assert "matches no placement" in capsys.readouterr().err


def test_advise_simulates_the_placement_an_eplb_trace_gives(tmp_path, capsys):
    """--eplb: experts placed by EPLB on a trace's picks, with spare slots, beside the contiguous
    order; on a trace of every pick on device 0 the placed experts are the faster."""
    argv = advise_with_step_trace(tmp_path, TRACED)[:-2]
    table = costs.load(tmp_path / "costs.json", dataclasses.replace(Config(), model=preset("tiny")))
    for key in (f"{ROWS},256,3", f"{ROWS},128,6"):  # 24 slots over 8 and over 4 ep groups
        table.compute_fit[key] = [5.0, 4.0, 16.0]
    costs.save(table, tmp_path / "costs.json")
    assert main(argv + ["--eplb", str(tmp_path / "t.npz"), "--redundant-experts", "8", "--json"]) == 0
    report = {p["placement"]: p for p in json.loads(capsys.readouterr().out)["placements"]}
    assert {name for name, p in report.items() if "eplb_placed" in p} == {"expert_sharded", "hybrid", "ragged_a2a"}
    sharded = report["expert_sharded"]
    assert sharded["eplb_placed"]["moe_ms"] < sharded["contiguous"]["moe_ms"]


def test_advise_refuses_spare_slots_without_a_placement_trace(tmp_path, capsys):
    assert main(advise_with_step_trace(tmp_path, TRACED)[:-2] + ["--redundant-experts", "8"]) == 2
    assert "goes with --eplb" in capsys.readouterr().err
