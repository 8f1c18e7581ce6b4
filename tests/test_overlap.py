"""Two-batch overlap: the same tokens and rows as the plain exchange, the same bytes, and a
compiled program whose micro-batches' exchanges interleave (issue order: XLA:CPU's collectives
are synchronous, so on this host nothing runs concurrently)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.compiled import hlo
from moejax.config import Config, ConfigError, LayoutConfig, preset
from moejax.engine.engine import Engine
from moejax.launch.loading import load_params
from moejax.model.transformer import layer_params
from sharding import accounting, make_placement
from sharding.overlap import MICROBATCHES

# The placements whose rows travel (weight_prefetch moves weights instead).
ROW_MOVERS = ["tensor_sliced", "expert_sharded", "hybrid", "ragged_a2a"]
# Shapes as tests/test_placements.py's runs (so a full run compiles the plain programs once):
# three requests under expert_sharded with TP attention (an odd batch; its 4 bucketed rows are
# on every device and split 2 + 2 in a decode step), and one request under ragged_a2a with DP
# attention (a decode step has one row per device: one micro-batch). The row-level tests below
# cover the other placements' exchanges.
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]
CASES = {
    "odd_batch_expert_sharded_tp": ("expert_sharded", "tp", PROMPTS),
    "batch_1_ragged_a2a_dp": ("ragged_a2a", "dp", PROMPTS[:1]),
}


def config(name: str, tbo: bool, attention: str = "dp") -> Config:
    layout = LayoutConfig(placement=name, devices=8, attention=attention, two_batch_overlap=tbo)
    return Config(model=preset("tiny"), layout=layout).validate()


@pytest.mark.parametrize("case", CASES)
def test_two_batch_overlap_generates_the_plain_tokens(case):
    name, attention, prompts = CASES[case]
    outs = []
    for tbo in (False, True):
        cfg = config(name, tbo, attention)
        placement = make_placement(cfg)
        outs.append(
            Engine(cfg, load_params(cfg, placement, seed=1), placement).generate(prompts, 5, return_logits=True)
        )
    plain, tbo = outs
    assert tbo.tokens == plain.tokens
    np.testing.assert_allclose(tbo.logits, plain.logits, rtol=0, atol=1e-5 * np.abs(plain.logits).max())


@functools.cache
def placed_experts(name: str, tbo: bool, attention: str):
    cfg = config(name, tbo, attention)
    placement = make_placement(cfg)
    return cfg, placement, layer_params(load_params(cfg, placement, seed=1), 1, cfg.model)["moe"]["experts"]


@functools.cache
def moe_rows(name: str, tbo: bool, rows_per_device: int, attention: str = "dp"):
    """One MoE layer's exchange on 8 * rows_per_device rows (each device's own under DP
    attention, all rows everywhere under TP attention): the output rows and the compiled program."""
    cfg, placement, experts = placed_experts(name, tbo, attention)
    t, d, k, e = 8 * rows_per_device, cfg.model.hidden_size, cfg.model.num_experts_per_tok, cfg.model.num_experts
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    args = [jnp.asarray(rng.standard_normal((t, d)), jnp.float32), ids, jnp.asarray(rng.random((t, k)), jnp.float32)]
    rows = placement.sharding(("batch", None) if attention == "dp" else (None, None), (t, d))
    args = [jax.device_put(a, rows) for a in args]
    fn = (
        jax.jit(lambda x, i, w, ex: placement.moe(x, i, w, placement.gather_experts(ex)))
        .lower(*args, experts)
        .compile()
    )
    return np.asarray(fn(*args, experts)), fn.as_text()


ROW_CASES = [(name, 3, "dp") for name in ROW_MOVERS] + [("ragged_a2a", 1, "dp"), ("ragged_a2a", 3, "tp")]


@pytest.mark.parametrize("name,rows_per_device,attention", ROW_CASES)
def test_two_batch_overlap_gives_each_row_the_plain_output(name, rows_per_device, attention):
    """Odd rows per device split 2 + 1; one row per device runs as one micro-batch; TP attention
    (every row on every device) splits the rows each device works on. (ragged_a2a with one
    row per device is a batch of 8 or fewer requests in a DP decode step.)"""
    plain, _ = moe_rows(name, False, rows_per_device, attention)
    tbo, _ = moe_rows(name, True, rows_per_device, attention)
    np.testing.assert_allclose(tbo, plain, rtol=0, atol=1e-5 * np.abs(plain).max())


@pytest.mark.parametrize("name", ["tensor_sliced", "expert_sharded", "hybrid"])
def test_two_batch_overlap_sends_the_bytes_of_the_plain_exchange(name):
    """The compiled collectives move what the placement's accounting counts, split or not."""
    (_, plain), (_, tbo) = moe_rows(name, False, 3), moe_rows(name, True, 3)
    assert accounting.hlo_collective_bytes(tbo) == accounting.hlo_collective_bytes(plain) > 0


def issue_order(text: str) -> list[str]:
    """'microbatch_x/phase' of each collective in the computation that issues them, in schedule
    order (a scheduled module prints each computation's instructions in the order they run)."""
    phases = [
        (r.computation, m.group(1))
        for r in hlo.collectives(text)
        for m in [re.search(r"(microbatch_[ab]/\w+)", r.instr.scope)]
        if m
    ]
    return [phase for computation, phase in phases if computation == phases[0][0]] if phases else []


@pytest.mark.parametrize("name", ["expert_sharded", "ragged_a2a"])
def test_micro_batch_b_dispatch_is_issued_inside_micro_batch_a_exchange(name):
    """Scheduled program: A's dispatch, then B's dispatch (beside A's experts), then A's combine
    (beside B's experts), then B's combine: B's rows are on their way before A's results return."""
    order = issue_order(moe_rows(name, True, 3)[1])
    a, b = MICROBATCHES
    phases = [p for i, p in enumerate(order) if i == 0 or p != order[i - 1]]  # runs of one phase
    assert phases == [f"{a}/dispatch", f"{b}/dispatch", f"{a}/combine", f"{b}/combine"]


def test_two_batch_overlap_is_refused_where_rows_stay_home():
    with pytest.raises(ConfigError, match="two_batch_overlap.*weight_prefetch"):
        make_placement(config("weight_prefetch", True))
