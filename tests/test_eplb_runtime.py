"""Expert placement at run time on a skewed model: the router's correction bias favours two
experts of device 0, so under expert_sharded on 8 devices that device computes most rows; a
placement from a recorded trace, with spare slots for replicas, spreads them."""

from __future__ import annotations

import io
import json

import jax.numpy as jnp
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moejax.analysis.record import model_trace
from moejax.base.trace import load_trace, save_trace
from moejax.cli import main
from moejax.config import Config, LayoutConfig, preset
from moejax.engine import compile_clock
from moejax.engine.engine import Engine
from moejax.engine.expert_placement import place_experts, trace_device_rows
from moejax.launch.loading import load_params
from moejax.serving.metrics import Metrics
from moejax.serving.online_eplb import OnlineEPLB
from moejax.serving.scheduler import Request, Scheduler
from moejax.serving.stopping import Stopper
from sharding import make_placement, slots

PROMPTS = [[i, i + 1, i + 2] for i in range(3, 60, 7)]  # 9 requests
STEPS = 12
HOT = (0, 1)  # experts 0 and 1: both on device 0 in the checkpoint order (2 experts per device)


def skew(params: dict, c) -> dict:
    """The router's correction bias raised for the HOT experts of every MoE layer."""

    def run(r, run_params):
        if "moe" not in run_params:
            return run_params
        bias = run_params["moe"]["router_bias"].at[..., jnp.asarray(HOT)].add(1.0)
        return {**run_params, "moe": {**run_params["moe"], "router_bias": bias}}

    return {**params, "layers": [run(r, p) for r, p in enumerate(params["layers"])]}


def skewed_engine(**layout) -> Engine:
    config = Config(
        model=preset("tiny"), layout=LayoutConfig(devices=8, placement="expert_sharded", **layout)
    ).validate()
    placement = make_placement(config)
    params = skew(load_params(config, placement, seed=3), config.model)
    params, phy2log = place_experts(params, placement, load_trace)
    return Engine(config, params, placement, phy2log=phy2log)


def record(engine, path):
    return save_trace(path, **model_trace(engine, PROMPTS, STEPS, "skewed tiny"))


@pytest.fixture(scope="module")
def checkpoint_order(tmp_path_factory):
    """(engine in the checkpoint order, its trace's path, the trace)."""
    engine, path = skewed_engine(), tmp_path_factory.mktemp("eplb") / "picks.npz"
    return engine, path, record(engine, path)


def balancedness(engine, trace) -> float:
    return slots.balancedness(trace_device_rows(trace, engine.phy2log, engine.placement))


def test_skewed_model_loads_one_device(checkpoint_order):
    engine, _, trace = checkpoint_order
    rows = trace_device_rows(trace, None, engine.placement)
    assert rows.argmax() == 0 and slots.balancedness(rows) < 0.4


def test_static_placement_from_a_trace_balances_device_rows(checkpoint_order, tmp_path):
    engine, path, trace = checkpoint_order
    placed = skewed_engine(redundant_experts=8, eplb=str(path))
    after = record(placed, tmp_path / "after.npz")
    assert balancedness(placed, after) >= 0.6
    assert after.ids.tolist() == trace.ids.tolist()  # the same picks at every step: the same tokens


def requests(n: int = 24):
    return [Request([3 + 5 * i % 90, 7 + i, 11], 8 + i % 5, Stopper(None)) for i in range(n)]


def serve(engine, online: bool = False):
    """(finished requests, its /metrics, the rebalancer or None, seconds compiled after warm-up)
    of `requests()` through a scheduler of 8 slots."""
    scheduler = Scheduler(engine, slots=8, max_len=32)
    rebalancer = OnlineEPLB(scheduler, window=16, interval=4, log=io.StringIO()) if online else None
    metrics = Metrics(scheduler, window=16)
    if rebalancer:
        rebalancer.warm_up()
    scheduler.warm_up()
    compile_clock.start()
    t0 = compile_clock.now()
    done = scheduler.run_all(requests())
    return done, metrics, rebalancer, compile_clock.compile_seconds(t0)


@pytest.fixture(scope="module")
def online():
    return serve(skewed_engine(), False), serve(skewed_engine(redundant_experts=8, eplb_online=True), True)


def test_online_rebalancing_keeps_every_requests_tokens(online):
    (plain, _, _, _), (done, _, rebalancer, _) = online
    assert len(rebalancer.rebalances) >= 3
    assert [r.tokens for r in done] == [r.tokens for r in plain] and all(r.finish_reason for r in done)


def test_online_rebalancing_balances_device_rows_without_a_trace(online):
    (_, plain, _, _), (_, metrics, _, _) = online
    assert slots.balancedness(plain.devices.recent()) < 0.4 and slots.balancedness(metrics.devices.recent()) >= 0.6


def test_nothing_compiles_after_warm_up_across_rebalances(online):
    (_, _, rebalancer, compiled) = online[1]
    assert rebalancer.rebalances and compiled == 0


def test_metrics_show_rows_per_device_balancedness_and_rebalances(online):
    (_, metrics, rebalancer, _) = online[1]
    samples = {
        (s.name, tuple(s.labels.items())): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples
    }
    rows = metrics.devices.recent()
    assert [samples["moejax_device_rows", (("device", str(d)),)] for d in range(8)] == rows.tolist()
    assert samples["moejax_device_balancedness", ()] == pytest.approx(slots.balancedness(rows))
    assert samples["moejax_eplb_rebalances", ()] == len(rebalancer.rebalances)
    assert samples["moejax_eplb_last_bytes_moved", ()] == rebalancer.rebalances[-1].bytes_moved


def test_bench_json_reports_device_rows_and_rebalances(capsys):
    assert (
        main(
            [
                "bench",
                "--preset",
                "tiny",
                "--devices",
                "8",
                "--placement",
                "expert_sharded",
                "--redundant-experts",
                "8",
                "--eplb-online",
                "--eplb-interval",
                "4",
                "--eplb-window",
                "8",
                "--num-prompts",
                "8",
                "--input-len",
                "4",
                "--output-len",
                "12",
                "--slots",
                "8",
                "--json",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    summary = json.loads(out.out)
    assert len(summary["device_rows"]) == 8 and sum(summary["device_rows"]) > 0
    assert summary["eplb"]["rebalances"] == out.err.count("eplb: rebalance")
    assert (
        summary["eplb"]["rebalances"] >= 1
        and summary["eplb"]["balancedness_after"] > summary["eplb"]["balancedness_before"]
    )


def test_tensor_sliced_refuses_online_placement(capsys):
    assert (
        main(
            ["generate", "--preset", "tiny", "--devices", "8", "--placement", "tensor_sliced", "--eplb", "missing.npz"]
        )
        == 2
    )
    assert "does not apply" in capsys.readouterr().err
