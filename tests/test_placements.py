"""Every placement gives the single-device model's tokens and logits on 8 virtual CPU devices;
no placement drops a pick; the communication accounting matches the compiled programs."""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from moejax.compiled import hlo
from moejax.config import Config, ConfigError, EngineConfig, LayoutConfig, WeightsConfig, preset
from moejax.engine.engine import Engine
from moejax.launch.loading import load_params
from moejax.model.transformer import layer_params
from sharding import accounting, make_placement, names
from sharding.experts import moe_local
from sharding.mesh import MeshPlacement
from sharding.ragged_a2a import RaggedA2A, dispatch_plan, exchange_buffers

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22]]
NEW = 5

# Every registered placement on its default mesh (the mix: 4 x 2), and the mix the other way round.
LAYOUTS = {**{name: {} for name in names()}, "hybrid_2x4": dict(placement="hybrid", ep=2, tp=4)}


def layout(name: str, **kw) -> LayoutConfig:
    spec = {"placement": name, **LAYOUTS.get(name, {}), **kw}
    return LayoutConfig(devices=8, **spec)


@functools.cache
def run(model_name: str, layout_cfg: LayoutConfig | None, fmt: str = "unquantized", **model_kw):
    model = dataclasses.replace(preset(model_name), **model_kw) if model_kw else preset(model_name)
    config = Config(model=model, layout=layout_cfg or LayoutConfig(), weights=WeightsConfig(fmt)).validate()
    placement = make_placement(config)
    engine = Engine(config, load_params(config, placement, seed=1), placement)
    return engine.generate(PROMPTS, NEW, return_logits=True)


CASES = [
    (m, name, att)
    for m in ("tiny", "tiny-qwen3-moe")
    for name in LAYOUTS
    for att in ("dp", "tp")
    if att == "dp" or m == "tiny"
]


@pytest.mark.parametrize("model,name,attention", CASES)
def test_placement_matches_single_device(model, name, attention):
    # Tensor-parallel attention comes with the vocab sliced too, as a CPU host's layout runs it.
    head = "tp" if attention == "tp" else "replicated"
    ref, got = run(model, None), run(model, layout(name, attention=attention, head=head))
    assert got.tokens == ref.tokens
    np.testing.assert_allclose(got.logits, ref.logits, rtol=0, atol=1e-4 * np.abs(ref.logits).max())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("name", names())
def test_4bit_experts_under_every_placement_match_single_device(name, fmt):
    """Slices of a 4-bit expert hold the same values and scales as the whole expert."""
    ref, got = run("tiny", None, fmt), run("tiny", layout(name), fmt)
    assert got.tokens == ref.tokens
    np.testing.assert_allclose(got.logits, ref.logits, rtol=0, atol=1e-4 * np.abs(ref.logits).max())


def test_nvfp4_dispatch_equals_the_experts_on_quantized_rows():
    """Rows travelling as NVFP4 are exactly the dequantized rows at their experts."""
    config = Config(model=preset("tiny"), layout=layout("ragged_a2a", dispatch_dtype="nvfp4")).validate()
    placement = make_placement(config)
    experts = layer_params(load_params(config, placement), 1, config.model)["moe"]["experts"]
    t, k = 32, config.model.num_experts_per_tok
    x = jax.random.normal(jax.random.key(0), (t, config.model.hidden_size))
    ids = jnp.asarray(even_router(t, config.model.num_experts, k))
    w = jax.random.uniform(jax.random.key(1), (t, k))
    rows = placement.sharding(("batch", None), x.shape)
    got = jax.jit(placement.moe)(*(jax.device_put(a, rows) for a in (x, ids, w)), experts)
    x_q = pallas_kernels.dequantize(pallas_kernels.quantize_rows(x, "nvfp4"))
    want = moe_local(x_q, ids, w, jax.tree.map(np.asarray, experts), kernel="xla", platform=placement.platform)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert not np.allclose(x_q, x)  # the rows really were quantized


# ----------------------------------------------------------------------------- nothing dropped


def adversarial_params(config, placement, key=0):
    """Every row picks experts 0 and 1, both on device 0 under 8-way expert parallelism."""
    params = load_params(config, placement, seed=key)
    for lp in params["layers"]:
        if "moe" in lp:
            lp["moe"]["router"] = jnp.zeros_like(lp["moe"]["router"])
            lp["moe"]["router_bias"] = jnp.zeros(lp["moe"]["router_bias"].shape).at[..., :2].set(10.0)
    return params


@functools.cache
def adversarial_run(layout_cfg: LayoutConfig):
    """The adversarial routing's run on one layout (the single-device one shared by every placement's test)."""
    model = dataclasses.replace(preset("tiny"), num_experts_per_tok=2, n_group=1, topk_group=1)
    config = Config(model=model, layout=layout_cfg).validate()
    placement = make_placement(config)
    engine = Engine(config, adversarial_params(config, placement), placement)
    return engine.generate(PROMPTS, 3, return_logits=True, record=True)


@pytest.mark.parametrize("name", ["expert_sharded", "ragged_a2a", "weight_prefetch", "tensor_sliced"])
def test_adversarial_routing_drops_nothing(name):
    ref, got = adversarial_run(LayoutConfig()), adversarial_run(layout(name))
    assert all((np.asarray(p) < 2).all() for step in got.picks for p in step)  # the routing is as built
    assert got.tokens == ref.tokens
    np.testing.assert_allclose(got.logits, ref.logits, rtol=0, atol=1e-4 * np.abs(ref.logits).max())


@pytest.mark.parametrize("name", ["expert_sharded", "ragged_a2a", "weight_prefetch", "hybrid"])
def test_expert_count_that_does_not_divide_the_devices(name):
    """20 experts on 8 devices (as 256 on 24): padded with empty experts, same tokens."""
    kw = dict(num_experts=20, n_group=1, topk_group=1)
    lay = layout(name, ep=8, tp=1) if name == "hybrid" else layout(name)
    assert run("tiny", lay, **kw).tokens == run("tiny", None, **kw).tokens


def test_slice_width_that_does_not_divide_is_a_clear_error():
    model = dataclasses.replace(preset("tiny"), moe_intermediate_size=36)
    with pytest.raises(ConfigError, match="expert intermediate size 36 cannot be sliced 8 ways"):
        make_placement(Config(model=model, layout=layout("tensor_sliced")).validate())


# ----------------------------------------------------------------------------- accounting


def glm_placement(name: str) -> MeshPlacement:
    return make_placement(Config(model=preset("glm-5.3"), layout=layout(name)).validate())


def even_router(rows: int, experts: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((rows, experts)), axis=1)[:, :k].astype(np.int32)


def test_glm_shaped_even_routing_sends_4_6_copies_against_7():
    """Row-Meets-Experts §4.3: 256 experts, top-8, 8 devices: 4.6 copies per row against 7."""
    ids = even_router(4096, 256, 8)
    assert glm_placement("ragged_a2a").copies_per_row(ids) == pytest.approx(4.6, abs=0.05)
    assert glm_placement("tensor_sliced").copies_per_row(ids) == 7.0
    ragged = glm_placement("ragged_a2a").bytes_sent_per_device(ids, 6144, 2).mean()
    sliced = glm_placement("tensor_sliced").bytes_sent_per_device(ids, 6144, 2).mean()
    # Per row: 4.6 dispatched copies (+ their picks) and 4.6 results back, against 7 + 7.
    assert ragged / sliced == pytest.approx(4.6 / 7, rel=0.02)


def moe_program_and_counts(name: str, **kw):
    """The compiled MoE exchange of one layer, and the accounting for the same picks."""
    config = Config(model=preset("tiny"), layout=layout(name, **kw)).validate()
    placement = make_placement(config)
    params = load_params(config, placement)
    experts = layer_params(params, 1, config.model)["moe"]["experts"]
    t, d, k = 32, config.model.hidden_size, config.model.num_experts_per_tok
    ids = jnp.asarray(even_router(t, config.model.num_experts, k))
    x, w = jnp.ones((t, d)), jnp.full((t, k), 0.25)
    rows = placement.sharding(("batch", None), (t, d))  # each device starts with its own rows
    x, ids, w = (jax.device_put(a, rows) for a in (x, ids, w))
    fn = jax.jit(lambda x, i, w_, e: placement.moe(x, i, w_, placement.gather_experts(e)))
    hlo = fn.lower(x, ids, w, experts).compile().as_text()
    sent = placement.bytes_sent_per_device(np.asarray(ids), d, 4, experts)
    return accounting.hlo_collective_bytes(hlo), sent


@pytest.mark.parametrize("name", ["tensor_sliced", "expert_sharded", "hybrid", "weight_prefetch"])
def test_accounting_equals_the_compiled_collectives(name):
    hlo_bytes, sent = moe_program_and_counts(name)
    assert hlo_bytes == pytest.approx(sent.mean(), rel=1e-6)


def test_ragged_dispatch_plan_lists_each_devices_rows_in_order():
    """Block d's slots hold, in order, the rows with a pick among d's experts, then T; its size is
    their count."""
    t, k, n, e_local = 12, 3, 4, 2
    ids = np.random.default_rng(0).permutation(n * e_local)[np.random.default_rng(1).integers(0, n * e_local, (t, k))]
    row_of_slot, sizes = dispatch_plan(jnp.asarray(ids), e_local, n)
    for d in range(n):
        rows = [r for r in range(t) if (ids[r] // e_local == d).any()]
        assert list(np.asarray(row_of_slot[d])) == rows + [t] * (t - len(rows)) and int(sizes[d]) == len(rows)


def test_ragged_accounting_is_within_the_worst_case_buffers_of_the_compiled_exchange():
    hlo_bytes, sent = moe_program_and_counts("ragged_a2a")
    assert 0 < sent.max() <= hlo_bytes


# ----------------------------------------------------------------------------- compiled programs


def test_ragged_receiver_expands_each_row_to_its_local_picks_only():
    """32 experts top-8 on 8 devices: a received row has at most 4 picks there, so the local
    experts run on 4 copies of each received slot, not 8 (the buffers `exchange_buffers` states)."""
    config = Config(model=preset("tiny-glm5"), layout=layout("ragged_a2a")).validate()
    placement = make_placement(config)
    experts = layer_params(load_params(config, placement), 1, config.model)["moe"]["experts"]
    t, d, k = 32, config.model.hidden_size, config.model.num_experts_per_tok
    rows = placement.sharding(("batch", None), (t, d))
    args = [jax.device_put(a, rows) for a in (jnp.ones((t, d)), jnp.zeros((t, k), jnp.int32), jnp.ones((t, k)))]
    text = jax.jit(placement.moe).lower(*args, experts).compile().as_text()
    slots, f = 8 * (t // 8), config.model.moe_intermediate_size  # n blocks of T_local slots
    assert (
        hlo.writes_of(text, [(slots * 4, f)]) and hlo.writes_of(text, [(slots * k, f)]) == []
    )  # the picks' activations
    buffers = exchange_buffers(t // 8, 8, k, 4, d, 4, d * 4)
    assert buffers["expert_rows"] == slots * 4 * d * 4


@pytest.mark.parametrize("tbo", [False, True])
def test_real_ragged_all_to_all_lowers_for_tpu_and_cuda(tbo):
    """XLA:CPU lacks ragged-all-to-all; the path TPUs and GPUs take must still lower (with two
    micro-batches, twice), at its least: one exchange of picks (every device's ids and weights,
    from which each plans its sends and what it receives), one dispatch of rows, one combine."""
    config = Config(model=preset("tiny"), layout=layout("ragged_a2a", two_batch_overlap=tbo)).validate()
    placement = RaggedA2A(config, use_ragged=True)
    experts = layer_params(load_params(config, placement), 1, config.model)["moe"]["experts"]
    t, d, k = 32, config.model.hidden_size, config.model.num_experts_per_tok
    rows = placement.sharding(("batch", None), (t, d))
    args = [jax.device_put(a, rows) for a in (jnp.ones((t, d)), jnp.zeros((t, k), jnp.int32), jnp.ones((t, k)))]
    # ragged_all_to_all is a custom call without export compatibility guarantees.
    allow = [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
    for platform in ("tpu", "cuda"):
        exported = jax.export.export(jax.jit(placement.moe), platforms=[platform], disabled_checks=allow)(
            *args, experts
        )
        module = exported.mlir_module()
        assert module.count("@ragged_all_to_all(") == 2 * (1 + tbo)
        # ids and weights: two all-gathers here, one collective once compiled (XLA combines them).
        assert module.count("stablehlo.all_gather") == 2 * (1 + tbo)
        assert module.count("stablehlo.all_to_all") == 0


def expert_loops_fed_by_gathers(text: str, gathered: list[tuple[int, ...]]) -> tuple[int, int]:
    """In the layer scan's body (the computation that holds both the all-gathers of full experts,
    `gathered` their shapes, and the expert loops, whiles over full experts): (expert loops, of them
    fed by a gather of that same computation, following operands)."""
    program = hlo.parse(text)
    # XLA:CPU may call a loop as a computation of its own, whose root is the while (jax 0.11 on).
    wrapped = {name for name, instrs in program.comps.items() if any(i.root and i.opcode == "while" for i in instrs)}

    def loop(i: hlo.Instr) -> bool:
        runs = i.opcode == "while" or (i.opcode == "call" and i.called("to_apply") in wrapped)
        return runs and any(s in gathered for s in i.shapes)

    for instrs in program.comps.values():
        gathers = [i.name for i in instrs if i.opcode == "all-gather" and i.shapes[0] in gathered]
        loops = [i.name for i in instrs if loop(i)]
        if gathers and loops:
            fed, frontier = set(gathers), list(gathers)
            users = collections.defaultdict(list)
            for u in instrs:
                for operand in u.operands:
                    users[operand].append(u.name)
            while frontier:
                for user in users[frontier.pop()]:
                    if user not in fed:
                        fed.add(user)
                        frontier.append(user)
            return len(loops), len(set(loops) & fed)
    raise AssertionError("no computation holds both the expert all-gathers and the expert loops")


@functools.cache
def prefetch_engine(depth: int) -> Engine:
    model = dataclasses.replace(preset("tiny"), num_layers=4)  # a run of 3 MoE layers
    # The layer scan, as accelerators run it (XLA:CPU unrolls by default).
    config = Config(
        model=model, layout=layout("weight_prefetch", prefetch_depth=depth), engine=EngineConfig(layer_loop="scan")
    ).validate()
    placement = make_placement(config)
    return Engine(config, load_params(config, placement), placement)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_weight_prefetch_expert_loops_compute_with_weights_gathered_iterations_earlier(depth):
    """In the compiled decode step's layer scan, at depth >= 1 no expert loop takes weights
    gathered in its own iteration (they come from the carry); at depth 0 all of them do."""
    from moejax.engine.sampling import Sampling

    engine = prefetch_engine(depth)
    c = engine.c
    # 64 requests: 8 rows per device, more picks than the grouped GEMM gathers row by row (it loops)
    args = (
        engine.params,
        engine.new_cache(64, 32),
        jnp.zeros(64, jnp.int32),
        jnp.zeros(64, jnp.int32),
        jnp.zeros(64, jnp.int32),
        1,
    )
    text = engine._decode.lower(*args, sampling=Sampling(), record=False).compile().as_text()
    e, d, f = c.num_experts, c.hidden_size, c.moe_intermediate_size
    loops, fed = expert_loops_fed_by_gathers(text, [(e, d, 2 * f), (e, f, d)])
    assert loops == 2  # gate_up, down
    assert fed == (2 if depth == 0 else 0)


def test_weight_prefetch_depths_give_the_same_tokens():
    tokens = [prefetch_engine(depth).generate(PROMPTS, 4).tokens for depth in (0, 1, 2)]
    assert tokens[0] == tokens[1] == tokens[2]
