"""`advise --target`: HLO read into priced operations, the target cost model (the B300 expert
slope of the placement study), the tiny model's layouts compiled for 8 H100s and ranked per
phase, and `serve --placement auto` choosing what `advise --target cpu` ranks first."""

import dataclasses
import io
import json

import numpy as np
import pytest

from moejax.analysis import advise_tables, calc, costs, hlo_ops, serve_ranking, target_programs, target_ranking
from moejax.analysis.simulate import Layout, device_work, layouts
from moejax.analysis.target_pricing import CATEGORIES, CallTime, category, expert_us, phase_us
from moejax.base import targets
from moejax.base.trace import Trace, save_trace
from moejax.cli import build_parser, main
from moejax.config import Config, EngineConfig, LayoutConfig, WeightsConfig, preset
from moejax.serving import layout_choice
from sharding import eplb

# A layer loop of 4 trips: a fusion slicing layer i out of a [4, 8, 16] stack (after a layout
# change, in a fusion of its own), a dot, two
# all-gathers over 8 devices the compiler combined into one, a custom call handed the whole stack
# (reshaped), a KV-cache-like update in place.
HLO = """HloModule m

%pick (s0: f32[4,8,16], s1: s32[]) -> f32[1,8,16] {
  %s0 = f32[4,8,16]{1,2,0} parameter(0)
  %s1 = s32[] parameter(1)
  ROOT %ds = f32[1,8,16]{2,1,0} dynamic-slice(%s0, %s1), dynamic_slice_sizes={1,8,16}
}

%slice (param_0: f32[4,8,16], param_1: s32[]) -> f32[8,16] {
  %param_0 = f32[4,8,16]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %relaid = f32[4,8,16]{1,2,0} copy(%param_0)
  %picked = f32[1,8,16]{2,1,0} fusion(%relaid, %param_1), kind=kLoop, calls=%pick
  ROOT %b = f32[8,16]{1,0} bitcast(%picked)
}

%dot (p0: f32[8,16], p1: f32[16,32]) -> f32[8,32] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,32]{1,0} parameter(1)
  ROOT %d = f32[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%update (q0: f32[4,8,32], q1: f32[8,32], q2: s32[]) -> f32[4,8,32] {
  %q0 = f32[4,8,32]{2,1,0} parameter(0)
  %q1 = f32[8,32]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  ROOT %u = f32[4,8,32]{2,1,0} dynamic-update-slice(%q0, %q1, %q2)
}

%body (arg: (s32[], f32[4,8,16], f32[16,32], f32[4,8,32])) -> (s32[], f32[4,8,16], f32[16,32], f32[4,8,32]) {
  %arg = (s32[], f32[4,8,16]{2,1,0}, f32[16,32]{1,0}, f32[4,8,32]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %stack = f32[4,8,16]{2,1,0} get-tuple-element(%arg), index=1
  %w = f32[16,32]{1,0} get-tuple-element(%arg), index=2
  %cache = f32[4,8,32]{2,1,0} get-tuple-element(%arg), index=3
  %x = f32[8,16]{1,0} fusion(%stack, %i), kind=kLoop, calls=%slice, metadata={op_name="jit(f)/attention/slice"}
  %y = f32[8,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%dot, metadata={op_name="jit(f)/moe/shard_map/experts/dot"}
  %ag = (f32[64,32]{1,0}, f32[64,16]{1,0}) all-gather(%y, %x), replica_groups=[1,8]<=[8], dimensions={0}, metadata={op_name="jit(f)/(moe/shard_map/all_gather:attention/all_gather)"}
  %flat = f32[32,16]{1,0} bitcast(%stack)
  %k = f32[8,16]{1,0} custom-call(%flat, %i), custom_call_target="__gpu$xla.gpu.triton"
  %c = f32[4,8,32]{2,1,0} fusion(%cache, %y, %i), kind=kLoop, calls=%update
  ROOT %t = (s32[], f32[4,8,16]{2,1,0}, f32[16,32]{1,0}, f32[4,8,32]{2,1,0}) tuple(%i, %stack, %w, %c)
}

%cond (carg: (s32[], f32[4,8,16], f32[16,32], f32[4,8,32])) -> pred[] {
  %carg = (s32[], f32[4,8,16]{2,1,0}, f32[16,32]{1,0}, f32[4,8,32]{2,1,0}) parameter(0)
  %counter = s32[] get-tuple-element(%carg), index=0
  %bound = s32[] constant(5)
  ROOT %p = pred[] compare(%counter, %bound), direction=LT
}

ENTRY %main (a: f32[4,8,16], b: f32[16,32], c: f32[4,8,32]) -> f32[4,8,32] {
  %a = f32[4,8,16]{2,1,0} parameter(0)
  %b = f32[16,32]{1,0} parameter(1)
  %c = f32[4,8,32]{2,1,0} parameter(2)
  %one = s32[] constant(1)
  %init = (s32[], f32[4,8,16]{2,1,0}, f32[16,32]{1,0}, f32[4,8,32]{2,1,0}) tuple(%one, %a, %b, %c)
  %loop = (s32[], f32[4,8,16]{2,1,0}, f32[16,32]{1,0}, f32[4,8,32]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %out = f32[4,8,32]{2,1,0} get-tuple-element(%loop), index=3
}
"""


@pytest.mark.parametrize("loop", ["known trip count", "bound in the condition"])
def test_hlo_ops_price_slices_updates_in_place_loops_and_collectives(loop):
    # XLA:GPU states the trip count; the TPU compiler leaves it to the condition: i from 1 while i < 5
    text = HLO if loop == "known trip count" else HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
    ops = hlo_ops.ops(text, 8)
    assert [(op.kind, op.count) for op in ops] == [("kernel", 4)] * 2 + [("all-gather", 4)] * 2 + [("kernel", 4)] * 2
    sliced, dot, rows, other, kernel, update = ops
    assert sliced.bytes == 512 + 4 + 512  # the layer's slice of the stack, its index, the result
    assert (dot.bytes, dot.flops) == (512 + 2048 + 1024, 2 * 8 * 32 * 16)
    # each part of the combined all-gather with its own scope and bytes, one latency for both
    assert (rows.scope, rows.bytes, rows.fixed) == ("jit(f)/moe/shard_map/all_gather", 7 * 1024, 1)
    assert (other.scope, other.bytes, other.fixed) == ("jit(f)/attention/all_gather", 7 * 512, 0)
    assert kernel.bytes == 512 + 4 + 512  # a kernel handed the whole stack reads one layer per trip
    assert update.bytes == 2 * (1024 + 4)  # the update and its index, not the cache it lands in
    assert [category(op) for op in ops] == [
        "attention",
        "experts",
        "exchange",
        "attention",
        "rest",
        "rest",
    ]


@pytest.mark.parametrize(
    "attrs, size",
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}", 4),
        ("replica_groups=[2,4]<=[8]", 4),
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}", 2),
        ("", 8),
    ],
)
def test_hlo_group_sizes(attrs, size):
    assert hlo_ops.group_size(attrs, 8) == size


def test_b300_expert_time_per_touched_gb_is_the_placement_studys():
    """B300 decode: 28 us + 150 us per GB of touched experts (Row-Meets-Experts); the model's slope
    over a GLM-5.3-like decode (64 rows, 8 devices) must lie within 25% of it."""
    from moejax.analysis import synthetic

    t, model = targets.target("b300"), preset("glm-5.3")
    trace = Trace(**synthetic.generate(synthetic.GLM_LIKE, 4, 64, 0))
    work = device_work(trace, Layout("expert_sharded", 8, 1), eplb.contiguous(75, 256), model.moe_intermediate_size)
    touched = work.experts * calc.expert_bytes(model)["nvfp4"]  # [S, L, N] bytes
    us = expert_us(t, 0.0, touched, 2 * calc.expert_params(model) * work.routes, 10, t.bf16_tflops)
    slope = np.polyfit(touched.ravel() / 1e9, us.ravel(), 1)[0]
    assert abs(slope - 150) <= 0.25 * 150, slope


# ----------------------------------------------------------------------------- a tiny model on 8 H100s

TINY = Config(
    model=preset("tiny"),
    layout=LayoutConfig(devices=8),
    weights=WeightsConfig("nvfp4"),
    engine=EngineConfig(dtype="bfloat16"),
).validate()


def even(rows: int, steps: int, seed: int = 0):
    return layout_choice.even_trace(TINY.model, rows, steps, seed)


@pytest.fixture(scope="module")
def h100():
    """The tiny model's expert_sharded and ragged_a2a layouts compiled for 8 H100s, ranked on an even router."""
    t = targets.target("h100")
    return target_ranking.rank_on_target(
        TINY, even(64, 8), t, list(targets.devices("h100", 8)), 256, 512, ["expert_sharded", "ragged_a2a"]
    )


def test_advise_ranks_each_phase_with_its_time_table(h100):
    ranking, _ = h100
    for phase in ("decode", "prefill"):
        rows = ranking.phases[phase].layouts
        assert sorted(r.layout for r in rows) == ["expert_sharded", "ragged_a2a"]
        assert [r.us.step for r in rows] == sorted(r.us.step for r in rows)
        for r in rows:
            assert r.us.step == pytest.approx(sum(getattr(r.us, c) for c in CATEGORIES))
            assert min(getattr(r.us, c) for c in CATEGORIES) > 0 and r.fits
        d = ranking.phases[phase].decides
        assert (d.first, d.second) == (rows[0].layout, rows[1].layout) and d.lead_us >= 0
    assert ranking.not_compiled == ()
    r = ranking.recommend
    assert r.decode == ranking.phases["decode"].layouts[0].layout
    assert r.apart == (r.decode != r.prefill) and r.decode in r.flags
    text = advise_tables.target_table("tiny", ranking)
    assert "decode (8 steps of 64 rows)" in text and "recommend: serve --" in text


def test_advise_gives_each_layout_a_layers_share_of_its_ops(h100):
    """Each layout's kernels, collectives and bytes a call runs, over the model's layers: some of
    each on 8 devices; the table prints them beside the times."""
    ranking, candidates = h100
    layers = preset("tiny").num_layers
    for r in ranking.phases["decode"].layouts:
        c = next(c for c in candidates if target_ranking.label(c.layout) == r.layout)
        ops = c.programs["decode"].ops
        assert r.layer.kernels == pytest.approx(
            sum(o.count * o.fixed for o in ops if o.kind == "kernel") / layers, abs=0.05
        )
        assert r.layer.kernels > 0 and r.layer.collectives > 0 and r.layer.gb > 0, r
    line = next(x for x in advise_tables.target_table("tiny", ranking).splitlines() if x.startswith("ragged_a2a"))
    ragged = next(r for r in ranking.phases["decode"].layouts if r.layout == "ragged_a2a")
    assert f"{ragged.layer.kernels:.1f}" in line.split()


def test_advise_json_keeps_its_keys(h100):
    ranking, _ = h100
    doc = json.loads(json.dumps(advise_tables.target_json("tiny", ranking)))
    assert list(doc) == [
        "model",
        "devices",
        "batch",
        "context",
        "prefill_chunk",
        "target",
        "phases",
        "recommend",
        "not_compiled",
    ]
    assert list(doc["target"]) == list(advise_tables.TARGET_FIGURES) and doc["target"]["name"] == "h100"
    decode = doc["phases"]["decode"]
    assert list(decode) == ["steps", "rows", "layouts", "decides"]
    assert list(decode["layouts"][0]) == ["layout", "placement", "ep", "tp", "memory_gb", "fits", "us", "layer"]
    assert list(decode["layouts"][0]["us"]) == ["step", *CATEGORIES]
    assert list(decode["layouts"][0]["layer"]) == ["kernels", "collectives", "gb"]
    assert set(decode["decides"]) == {"first", "second", "lead_us", "part", "part_us"}
    assert doc["recommend"]["flags"] == ranking.recommend.flags


def row(name: str, us: float, gb: float) -> target_ranking.RankedLayout:
    share = target_ranking.LayerShare(20.0, 2.0, 0.1)
    return target_ranking.RankedLayout(
        name, name, 8, 1, gb, gb <= 32, CallTime.of(dict.fromkeys(CATEGORIES, us / 4)), share
    )


def test_a_layout_that_alone_fits_leads_by_its_memory():
    d = target_ranking.decides((row("tensor_sliced", 900.0, 31.7), row("expert_sharded", 100.0, 33.2)))
    assert d.part == "memory" and d.part_gb == pytest.approx(1.5) and d.lead_us == pytest.approx(-800)
    assert d.part_us is None
    assert target_ranking.decides((row("a", 100.0, 20), row("b", 140.0, 20))).part_us == pytest.approx(10)


def test_a_lead_by_memory_and_a_layout_not_compiled_are_printed():
    rows = (row("tensor_sliced", 900.0, 31.7), row("expert_sharded", 100.0, 33.2))
    phase = target_ranking.PhaseRanking(2, 8, rows, target_ranking.decides(rows))
    phases = {"decode": phase, "prefill": phase}
    refused = target_programs.NotCompiled("weight_prefetch", "its decode does not compile: RESOURCE_EXHAUSTED")
    ranking = target_ranking.TargetRanking(
        8, 8, 256, 512, targets.target("v6e"), phases, target_ranking.recommend(phases), (refused,)
    )
    text = advise_tables.target_table("tiny", ranking)
    assert "tensor_sliced leads expert_sharded, 800.0 us slower, by fitting 32 GB: 1.5 GB a device less" in text
    assert "weight_prefetch: its decode does not compile: RESOURCE_EXHAUSTED" in text
    doc = advise_tables.target_json("tiny", ranking)
    assert set(doc["phases"]["decode"]["decides"]) == {"first", "second", "lead_us", "part", "part_gb"}
    assert doc["not_compiled"] == [{"layout": "weight_prefetch", "error": refused.error}]


def picks(rule) -> Trace:
    """8 decode steps of 64 rows (8 per device), row r of device d = r // 8 picking rule(d)."""
    ids = np.array([rule(r // 8) for r in range(64)], np.int32)  # [64, 4]
    return dataclasses.replace(even(64, 8), ids=np.broadcast_to(ids, (8, 2, 64, 4)).copy())


def test_the_trace_sets_the_busiest_devices_experts_and_travelling_rows():
    """A hand-made program: per MoE layer one expert kernel reading its 2 local experts of 1 MB, and
    ragged all-to-alls sized for all 8 rows of a device going to the 7 others."""
    t, per_expert, ragged = targets.target("h100"), 1e6, 7 * 8 * 1e3
    ops = [
        hlo_ops.Op("kernel", "moe/shard_map/experts/gemm", 2 * per_expert + 1e3, 0.0, 2.0),
        hlo_ops.Op("ragged-all-to-all", "", ragged, 0.0, 2.0),
    ]
    c = target_programs.Candidate(
        Layout("ragged_a2a", 8, 1), "triton", per_expert, 0.0, {"decode": target_programs.Program(tuple(ops), 8)}
    )
    price = lambda trace: phase_us(c, "decode", trace, t, TINY.model)
    hot = price(picks(lambda d: [0, 1, 2, 3]))  # every row to devices 0 and 1, which read both their experts
    thin = price(picks(lambda d: [0, 2, 4, 6]))  # every row to devices 0-3, which read one expert each
    near = price(picks(lambda d: [2 * d, 2 * d + 1, (2 * d + 2) % 16, (2 * d + 3) % 16]))  # own device and the next
    layer_us = lambda touched: max((1e3 + touched * per_expert) / (t.hbm_tb_s * 1e6), 0.0) + t.launch_us
    assert hot.experts == pytest.approx(2 * layer_us(2)) and thin.experts == pytest.approx(2 * layer_us(1))
    # device 0 receives the 56 rows of the others: the compiled worst case; the next device's 8: 1/7 of it
    full = 2 * ragged / (t.link_gb_s * 1e3)
    assert hot.exchange == pytest.approx(full + 2 * t.collective_us)
    assert near.exchange == pytest.approx(full / 7 + 2 * t.collective_us)


def test_one_device_prices_the_one_program_every_placement_is():
    """One GPU: a single layout, no exchange, what a serve on it runs (no placement to pick)."""
    t = targets.target("h200")
    config = dataclasses.replace(TINY, layout=LayoutConfig(devices=1))
    ranking, _ = target_ranking.rank_on_target(
        config, even(4, 4), t, list(targets.devices("h200", 1)), 256, 512, ["expert_sharded", "ragged_a2a"]
    )
    for phase in ("decode", "prefill"):
        [only] = ranking.phases[phase].layouts
        assert only.layout == target_programs.ONE_DEVICE and only.us.exchange == 0 < only.us.step
    assert ranking.recommend.flags == "--devices 1"


def test_hybrid_is_tried_at_every_mesh():
    assert [(l.ep, l.tp) for l in target_programs.layouts(TINY, 8, ["hybrid"])] == [(2, 4), (4, 2)]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--eplb", "t.npz"], "--eplb, --step-trace and --costs go with --target cpu"),
        (["--placements", "nosuch"], "nosuch"),
    ],
)
def test_advise_target_bad_input_is_one_line(tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    save_trace("t.npz", **dataclasses.asdict(even(8, 2)))
    assert main(["advise", "t.npz", "--preset", "tiny", "--target", "h100", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


# ----------------------------------------------------------------------------- serve --placement auto on a CPU


def table_for(config: Config, trace, n: int) -> costs.CostTable:
    """A cost table holding every entry `advise` needs for `trace` on n devices (nothing to measure),
    with exchanges far apart so that one placement leads."""
    c, table = config.model, costs.CostTable(costs.geometry_key(config), config.model.moe_intermediate_size, 1 << 20)
    rows = int(-(-trace.valid.sum(axis=1).max() // n) * n)
    for layout, us in zip(layouts(n), (50.0, 40.0, 30.0, 5.0, 60.0)):
        work = device_work(
            trace.select([0]), layout, eplb.contiguous(len(c.moe_layers), c.num_experts), c.moe_intermediate_size
        )
        table.compute_fit[f"{int(work.rows[0])},{work.width},{work.held}"] = [5.0, 1.0, 2.0]
        table.exchange[f"{layout.name},{layout.ep},{layout.tp},{rows}"] = us
    return table


def test_serve_placement_auto_takes_what_advise_ranks_first_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(costs, "COSTS_DIR", tmp_path)
    config = dataclasses.replace(Config(), model=preset("tiny"))  # serve's and advise's defaults: tiny, auto dtype
    trace = layout_choice.even_trace(config.model, 16)  # serve's: --slots 16 rows of an even router
    costs.save(table_for(config, trace, 8), costs.default_path(config))
    save_trace(tmp_path / "even.npz", **dataclasses.asdict(trace))
    assert main(["advise", str(tmp_path / "even.npz"), "--preset", "tiny", "--devices", "8", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["ranking"][0]
    args = build_parser().parse_args(["serve", "--preset", "tiny", "--devices", "8", "--placement", "auto"])
    log = io.StringIO()
    choice = layout_choice.choose(args, serve_ranking.rank, log)
    assert args.placement == "auto"  # the caller applies the choice: its flags are `choice.layout`
    layout = choice.layout
    assert (layout.devices, layout.placement, layout.prefill_placement, layout.decode_placement) == (
        8,
        first,
        None,
        None,
    )
    assert f"decode and prefill {first}, predicted" in log.getvalue() and len(log.getvalue().splitlines()) == 1
    metric = next(iter(choice.collect()))
    assert {s.labels["layout"] for s in metric.samples} == {first} and {s.labels["target"] for s in metric.samples} == {
        "cpu"
    }


def test_online_eplb_readvises_on_the_live_window_and_logs_a_better_layout():
    """Every --eplb-interval steps the decode layouts are ranked again on the window; a layout
    faster by more than the margin is logged (and shown in /metrics), the server keeps its own."""
    from types import SimpleNamespace

    window = [(np.zeros((2, 8, 4), np.int32), np.ones(8, bool))] * 3
    eplb_ = SimpleNamespace(interval=2, passes=window, engine=SimpleNamespace(c=TINY.model))
    scheduler = SimpleNamespace(rebalancer=eplb_, between_steps=[])
    ranked = [[("ragged_a2a", 95.0), ("expert_sharded", 100.0)], [("ragged_a2a", 80.0), ("expert_sharded", 100.0)]]
    seen, log = [], io.StringIO()

    def rerank(trace):
        seen.append(trace.ids.shape)
        return ranked[len(seen) - 1]

    choice = layout_choice.LayoutChoice(
        "h100", {"decode": serve_ranking.Ranked("expert_sharded", "expert_sharded", 8, 1, 100.0)}, [], rerank, log
    )
    choice.follow(scheduler)
    for _ in range(4):
        scheduler.between_steps[0]()
    assert seen == [(3, 2, 8, 4)] * 2  # at steps 2 and 4, on the window's 3 passes
    lines = log.getvalue().splitlines()  # 5% faster at step 2: under the margin; 20% at step 4
    assert len(lines) == 1 and "step 4" in lines[0] and "ragged_a2a would decode in 80.0 us" in lines[0]
    assert [s.labels["layout"] for m in choice.collect() for s in m.samples] == ["expert_sharded", "ragged_a2a"]
