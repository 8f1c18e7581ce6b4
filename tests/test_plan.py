"""`moejax plan`: full-size per-device bytes from abstract compilation, checked against the
closed form (`calc`) and against the bytes a live run really allocates."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from moejax.analysis import calc, layer_ops
from moejax.cli import main
from moejax.compiled import plan
from moejax.compiled.abstract_arrays import abstract_params, bytes_per_device
from moejax.compiled.plan import compile_program, kv_pages, plan_placement
from moejax.config import Config, EngineConfig, LayoutConfig, WeightsConfig, preset
from moejax.engine.engine import Engine
from moejax.launch.loading import load_params
from moejax.verbs import plan_command
from moejax.verbs.compare import param_bytes_per_device
from sharding import make_placement
from sharding.ragged_a2a import exchange_buffers


@pytest.mark.slow
def test_plan_of_glm_reports_calcs_expert_bytes_per_device(capsys):
    assert (
        main(
            [
                "plan",
                "--preset",
                "glm-5.3",
                "--devices",
                "8",
                "--placement",
                "ragged_a2a",
                "--batch",
                "64",
                "--context",
                "4096",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    (row,) = report["placements"]
    closed_form = calc.expert_bytes(preset("glm-5.3"))["nvfp4"] * 256 * 75 / 8  # values + block scales
    assert row["expert_bytes_per_device"] == pytest.approx(closed_form, rel=0.01)
    assert row["total_bytes_per_device"] == (
        row["param_bytes_per_device"] + row["kv_cache_bytes_per_device"] + row["temp_bytes_per_device"]
    )
    assert row["fits"] == (row["total_bytes_per_device"] <= 288e9)
    c = preset("glm-5.3")  # ragged_a2a's worst-case buffers for 64 decode rows: 8 per device, bf16 rows
    d = c.hidden_size
    want = exchange_buffers(64 // 8, 8, c.num_experts_per_tok, c.num_experts // 8, d, 2, d * 2)
    assert row["exchange_buffer_bytes_per_device"]["decode"] == sum(want.values())


def test_plan_of_one_device_reports_it_once(capsys):
    """On one device every placement is the same single device: one row."""
    assert main(["plan", "--preset", "tiny", "--devices", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["placements"]
    assert row["fits"]
    assert row["decode_kernels"] is None  # XLA:CPU's program: not a target's kernels


def decode_only(monkeypatch) -> None:
    """`plan.programs` with the decode step alone: what a test of its figures compiles."""
    every = plan.programs

    def decode(*args, **kwargs):
        placement, programs = every(*args, **kwargs)
        return placement, {"decode": programs["decode"]}

    monkeypatch.setattr(plan, "programs", decode)


def unmeasured(monkeypatch) -> None:
    """`plan --target` with no layer of its decode step measured (two more compiles): the v5e's test
    holds that."""
    monkeypatch.setattr(plan_command, "layer_ops", lambda *a, **k: {"depths": [3, 4], "error": "not measured"})


def test_plan_for_a_target_counts_its_decode_steps_kernel_launches_a_layer(capsys, monkeypatch):
    """plan --target h100: its decode step's kernel launches (the Triton kernels among them, at least
    gate_up and down a MoE layer), by kind, over the model's layers, and the temporaries it writes
    of a layer weight's shape (none at 8 rows: every product a GEMM reading its weight in place),
    and each Pallas kernel's programs, bytes read and time at the datasheet bandwidth; the table
    prints them. (Only the decode step compiles here: the figures are its. Triton's kernels named:
    `auto`'s Mosaic GPU set refuses the tiny model's widths.)"""
    decode_only(monkeypatch)
    unmeasured(monkeypatch)
    argv = ["plan", "--preset", "tiny", "--devices", "1", "--target", "h100", "--batch", "8", "--context", "64"]
    argv += ["--kernel", "triton"]
    assert main([*argv, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["placements"]
    c, kernels = preset("tiny"), row["decode_kernels"]
    moe_layers = c.num_layers - len(c.dense_layers)
    assert kernels["launch_kinds"]["custom-call __gpu$xla.gpu.triton"] >= 2 * moe_layers
    assert kernels["launches"] == pytest.approx(sum(kernels["launch_kinds"].values()))
    assert kernels["launches_per_layer"] == pytest.approx(kernels["launches"] / c.num_layers, abs=0.05)
    assert kernels["weight_shaped"] == 0
    # Each Pallas kernel: its programs against the H100's 132 SMs, its operands' bytes and their
    # time at 3.35 TB/s; a MoE layer's gate_up and down among them, every layer's calls counted.
    figures = kernels["kernels"]
    assert "experts _kernel" in {f["kernel"] for f in figures}, figures
    assert sum(f["calls"] for f in figures) == kernels["launch_kinds"]["custom-call __gpu$xla.gpu.triton"] + (
        kernels["launch_kinds"].get("custom-call mosaic_gpu_v2", 0)
    )
    for f in figures:
        assert f["programs"] > 0 and f["sms"] == 132 and f["bytes"] > 0, f
        assert f["us"] == pytest.approx(f["bytes"] / 3.35e6, abs=0.01)
    monkeypatch.setattr(plan_command, "plan_placement", lambda *a, **k: row)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"decode step, per layer (of {c.num_layers}): {kernels['launches_per_layer']:.1f} kernel launches" in out
    f = figures[0]
    assert f"{f['kernel']:<28}{f['programs']:>9}{132:>5}{f['bytes'] / 1e6:>9.2f}{f['us']:>16.2f}" in out


def test_plan_for_a_tpu_prints_a_layer_of_its_decode_step(capsys, monkeypatch):
    """plan --target v5e: a layer of the decode step, the steps of 4 and 3 layers less one another,
    its synchronous ops by group (the async starts apart) and by part of the layer and kind, the
    bytes it moves and the whole step's time at the v5e's 0.819 TB/s, and the layer and the step
    priced on the v5e; --json holds them, the table prints them. (Only the decode steps compile
    here.)"""
    decode_only(monkeypatch)
    argv = [
        "plan",
        "--preset",
        "tiny-qwen3-moe",
        "--devices",
        "1",
        "--target",
        "v5e",
        "--batch",
        "8",
        "--context",
        "64",
    ]
    assert main([*argv, "--expert-format", "unquantized", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["placements"]
    ops = row["layer_ops"]
    assert ops["depths"] == [3, 4]
    assert ops["ops"] == pytest.approx(sum(ops["groups"][g] for g in layer_ops.GROUPS))
    assert ops["ops"] == pytest.approx(sum(p["ops"] for p in ops["parts"]))
    parts = {p["part"] for p in ops["parts"] if p["kind"] == "custom-call tpu_custom_call"}
    assert {"attention/ragged_paged_attention_kernel", "moe/experts"} <= parts, ops["parts"]
    step = ops["layer_bytes"] * (preset("tiny-qwen3-moe").num_layers - 3)
    assert 0 < ops["layer_bytes"] and step < ops["step_bytes"]
    assert ops["step_us"] == pytest.approx(ops["step_bytes"] / 0.819e6, abs=0.1)
    # priced on the v5e: the layer's kernels (one chip: no collectives), its time by part, the step
    p = ops["predicted"]
    assert p["target"] == "v5e" and p["collectives"] == 0
    assert p["kernels"] == pytest.approx(ops["ops"]) and p["layer_bytes"] == ops["layer_bytes"]
    assert p["layer_us"] == pytest.approx(sum(p["layer_parts_us"].values()))
    assert p["layer_parts_us"]["attention"] > 0 and p["layer_parts_us"]["experts"] > 0, p
    assert p["layer_us"] >= ops["layer_bytes"] / 0.819e6
    more = preset("tiny-qwen3-moe").num_layers - 3
    assert p["step_ms"] == pytest.approx((p["shallow_step_us"] + more * p["layer_us"]) / 1e3, rel=1e-3)
    monkeypatch.setattr(plan_command, "plan_placement", lambda *a, **k: row)
    monkeypatch.setattr(plan_command, "layer_ops", lambda *a, **k: ops)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"a layer (the step of 4 layers less that of 3): {ops['ops']:g} synchronous ops (fusions" in out
    assert "us at 0.819 TB/s" in out
    assert "priced on v5e (estimates: every op from HBM, no overlap, no routing;" in out
    assert f"a layer {p['kernels']:g} kernels, 0 collectives, {p['layer_bytes'] / 1e6:.1f} MB, " in out
    assert f"the step of {preset('tiny-qwen3-moe').num_layers} layers {p['step_ms']:.2f} ms" in out


def test_plan_for_an_ampere_gpu_compiles_every_program_with_tritons_kernels(capsys, monkeypatch):
    """plan --target a100: no wgmma or tcgen05 there, so `auto` runs Triton's grouped GEMM and decode
    kernels; the decode step, a decode block and a prefill chunk all compile for sm_80, and the
    decode step calls no Mosaic GPU kernel."""
    unmeasured(monkeypatch)
    argv = ["plan", "--preset", "tiny", "--devices", "1", "--target", "a100", "--batch", "8", "--context", "64"]
    assert main([*argv, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["placements"]
    assert row["kernel"] == "triton"
    assert set(row["programs"]) == {"decode", "decode block", "prefill"}
    assert all(p["compiled"] for p in row["programs"].values()), row["programs"]
    kinds = row["decode_kernels"]["launch_kinds"]
    assert kinds.get("custom-call __gpu$xla.gpu.triton", 0) > 0
    assert not [kind for kind in kinds if "mosaic" in kind]


@pytest.mark.parametrize(
    "placement,fmt,devices",
    [("hybrid", "nvfp4", 8), ("expert_sharded", "unquantized", 8), ("expert_sharded", "unquantized", 1)],
)
def test_plan_bytes_are_those_a_live_run_allocates(placement, fmt, devices):
    config = Config(
        model=preset("tiny"), layout=LayoutConfig(placement=placement, devices=devices), weights=WeightsConfig(fmt)
    ).validate()
    planned = plan_placement(config, batch=16, context=64, prefill_chunk=64, hbm_gb=1.0)
    live = make_placement(config)
    engine = Engine(config, load_params(config, live), live)
    cache = engine.new_cache(16, 64)
    assert planned["param_bytes_per_device"] == param_bytes_per_device(engine.params)
    assert planned["kv_cache_bytes_per_device"] == max(
        sum(s.data.nbytes for leaf in jax.tree.leaves(cache) for s in leaf.addressable_shards if s.device == d)
        for d in jax.devices()[:devices]
    )


@pytest.mark.parametrize("model", ["glm-5.3", "mixtral-8x7b"])
def test_kv_pages_per_device_and_the_requests_they_fit_by_attention_mode(model):
    """100 GB free per device on 8, pages of 16, requests of 1,000 + 150 positions (72 pages).
    Bytes per position and layer: MLA's latent + rope key (+ DSA's indexer key where a layer has
    an indexer), held whole by whichever device holds the page in either mode; GQA's 2 H_kv Dh,
    under TP attention each device holding its 1/8 of the kv heads. So under DP attention (each
    device its own pool) GLM-5 fits 8x the requests of TP attention; Mixtral (8 kv heads) alike."""
    c = preset(model)
    if c.is_mla:
        indexers = sum(c.has_indexer(i) for i in range(c.num_layers))
        position = 2 * (c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim) + indexers * c.index_head_dim)
        tp_share = 1
    else:
        position, tp_share = 2 * c.num_layers * 2 * c.num_kv_heads * c.head_dim, 8
    free, page, need = 100e9, 16 * position, -(-1150 // 16)

    def fit(mode: str) -> dict:
        config = Config(
            model=c,
            layout=LayoutConfig(placement="expert_sharded", devices=8, attention=mode),
            engine=EngineConfig(dtype="bfloat16"),
        ).validate()
        return kv_pages(config, make_placement(config), free, 16, 1000, 150)

    dp, tp = fit("dp"), fit("tp")
    assert (dp["page_bytes_per_device"], tp["page_bytes_per_device"]) == (page, page // tp_share)
    assert dp["requests"] == 8 * (int(free // page) // need)
    assert tp["requests"] == int(free // (page // tp_share)) // need
    if c.is_mla:
        assert dp["requests"] == 8 * tp["requests"]


def test_a_program_that_does_not_compile_is_reported_with_its_reason():
    """plan reports a program its target's compiler refuses with the reason's first line, and goes on."""
    args = (jax.ShapeDtypeStruct((2, 3), jnp.float32), jax.ShapeDtypeStruct((4, 5), jnp.float32))
    compiled, seconds, error = compile_program(jax.jit(lambda a, b: a @ b), args)
    assert compiled is None and seconds >= 0
    assert "dot_general requires contracting dimensions to have the same shape" in error and "\n" not in error


def test_spare_slots_grow_expert_bytes_per_device_by_their_share():
    """`plan --redundant-experts 32` of GLM-5.3 (256 experts): each device holds 288 / 256 of the
    expert bytes, the slot tables beside them."""

    def expert_bytes(spare: int) -> int:
        config = Config(
            model=preset("glm-5.3"),
            layout=LayoutConfig(devices=8, placement="expert_sharded", redundant_experts=spare),
            weights=WeightsConfig("nvfp4"),
            engine=EngineConfig(dtype="bfloat16"),
        ).validate()
        params = abstract_params(config, make_placement(config))
        return bytes_per_device([run["moe"]["experts"] for run in params["layers"] if "moe" in run])

    assert expert_bytes(32) * 256 == expert_bytes(0) * 288
