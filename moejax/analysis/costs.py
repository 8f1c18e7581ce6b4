"""The simulator's cost table, measured on this machine and cached as JSON.

  compute   per call shape (rows, slice width, experts held): microseconds of one device's local
            expert call (`sharding.experts.moe_local`) as base + per_route * routes + per_expert *
            distinct experts, least squares over routings that move routes and experts apart.
  exchange  per placement, mesh and rows: microseconds of one MoE layer (`placement.moe`, and for
            a placement that moves weights, its expert gather) minus the simulated expert phase of the same picks.
  non_moe   per device count and rows: microseconds of a decode step outside the MoE exchange and
            expert calls (attention, dense layers, router, shared expert, dispatch), fitted once
            from one measured step (`fit_non_moe`).

Times are taken inside one jitted scan of REPS calls, so per-call dispatch is not counted (inside
a model step there is none either).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import scipy.optimize

from moejax.analysis import simulate as simulation
from moejax.analysis.simulate import Layout, device_work, layouts, padded_rows, phase_us, simulate
from moejax.base import platform
from moejax.base.errors import UsageError
from moejax.base.trace import Trace
from moejax.config import Config
from sharding import eplb

COSTS_DIR = Path.home() / ".cache/moejax/costs"
REPS = 16  # calls per timed scan
ROUNDS = 7  # timed runs of each measurement; the best counts
ROUTINGS = ((1.0, 1), (1.0, 0), (0.5, 0), (0.25, 1), (0.1, 0), (0.0, 0))  # (local share, local experts 1 or all)


@dataclasses.dataclass
class CostTable:
    model: str  # geometry the table was measured for (`geometry_key`)
    intermediate: int  # expert intermediate width (unsliced)
    concurrency: int  # devices that truly run at once (host cores for virtual CPU devices)
    compute_fit: dict = dataclasses.field(default_factory=dict)  # "rows,width,held" -> [base, route, expert] us
    exchange: dict = dataclasses.field(default_factory=dict)  # "name,ep,tp,rows" -> us per layer
    non_moe: dict = dataclasses.field(default_factory=dict)  # "n,rows" -> us per step

    def compute(self, rows: int, width: int, held: int) -> list[float]:
        return self.compute_fit[f"{rows},{width},{held}"]

    def exchange_us(self, layout: Layout, rows: int) -> float:
        return self.exchange[f"{layout.name},{layout.ep},{layout.tp},{rows}"]

    def non_moe_us(self, n: int, rows: int) -> float:
        return self.non_moe.get(f"{n},{rows}", float("nan"))


def geometry_key(config: Config) -> str:
    c = config.model
    return (
        f"{c.family} D{c.hidden_size} F{c.moe_intermediate_size} E{c.num_experts} k{c.num_experts_per_tok} "
        f"L{len(c.moe_layers)} {platform.run_dtype(config.engine.dtype)} {config.weights.expert_format} {config.kernel}"
    )


def default_path(config: Config) -> Path:
    """Where this geometry's table is cached."""
    return COSTS_DIR / f"{hashlib.sha1(geometry_key(config).encode()).hexdigest()[:12]}.json"


def measure_and_rank(
    config: Config,
    trace: Trace,
    n: int,
    path: Path | None = None,
    placed: np.ndarray | None = None,
    spare_slots: int = 0,
) -> dict:
    """`simulate.rank_placements`'s report on this machine's table at `path` (default: `default_path`),
    measuring first what the trace needs and the table lacks."""
    from moejax.launch.factory import ensure_devices

    ensure_devices(n)  # the exchange is measured on an n-device mesh; before the dtype asks jax for its backend
    path = path or default_path(config)
    table = load(path, config)
    ensure(table, config, trace, n)
    if placed is not None:
        ensure_slots(table, config, trace, n, spare_slots)
    save(table, path)
    try:
        return {**simulation.rank_placements(trace, n, table, placed, spare_slots), "costs": str(path)}
    except ValueError as e:
        raise UsageError(str(e)) from None


def load(path: Path, config: Config) -> CostTable:
    """The cached table at `path` if it was measured for this geometry, else an empty one."""
    if path.is_file():
        try:
            table = CostTable(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise UsageError(f"{path} is not a moejax cost table: {e}") from None
        if table.model == geometry_key(config):
            return table
    concurrency = platform.resolve().concurrent_devices()
    return CostTable(geometry_key(config), config.model.moe_intermediate_size, concurrency)


def save(table: CostTable, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(table), indent=1))
    except OSError as e:
        raise UsageError(f"cannot write cost table {path}: {e.strerror}") from None


# ----------------------------------------------------------------------------- timing


def _timer(fn, *args):
    """Compiles fn(*args) (a jitted scan of REPS calls); returns a function timing one run, in
    microseconds per call."""
    fn(*args).block_until_ready()

    def once() -> float:
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        return 1e6 * (time.perf_counter() - t0) / REPS

    return once


def _best_us(fn, *args) -> float:
    """Microseconds per call, best of ROUNDS runs (the host is shared: the best run is the least disturbed)."""
    once = _timer(fn, *args)
    return min(once() for _ in range(ROUNDS))


def _repeated(call):
    """jit(x, *rest) -> x after REPS dependent calls x <- x + 1e-3 * call(x, *rest)."""
    import jax

    def run(x, *rest):
        def body(_, x):
            # Tying the loop-invariant inputs to the loop-varying x keeps XLA from hoisting out of
            # the loop what depends on them alone (sorting the picks, gathering ids or weights),
            # which would time that work once rather than once per call.
            x, tied = jax.lax.optimization_barrier((x, rest))
            return x + 1e-3 * call(x, *tied)

        return jax.lax.fori_loop(0, REPS, body, x)

    return jax.jit(run)


def routing(rows: int, k: int, num_experts: int, held: int, share: float, spread: int, rng) -> np.ndarray:
    """int32[rows, k]: each row's k distinct picks, a `share` of them on the local experts [0, held)
    (all of them when spread, else one expert), the rest on the others (whole-batch routes either way)."""
    p = np.zeros(num_experts)
    local = held if spread else 1
    if held < num_experts:
        p[held:] = (1 - share) / (num_experts - held)
        p[:local] += share / local
    else:
        p[:] = 1.0
    p /= p.sum()
    if (p > 0).sum() < k:
        p[p == 0] = 1e-3
        p /= p.sum()
    return np.stack([rng.choice(num_experts, k, replace=False, p=p) for _ in range(rows)]).astype(np.int32)


def measure_compute(config: Config, rows: int, width: int, held: int, seed: int = 0) -> list[float]:
    """[base, per_route, per_expert] microseconds of one device's `moe_local` call of this shape."""
    import jax.numpy as jnp

    import pallas_kernels
    from sharding.experts import moe_local
    from sharding.placement import gemm_kernel

    here = platform.resolve()
    c, dtype = config.model, jnp.dtype(here.run_dtype(config.engine.dtype))
    rng = np.random.default_rng(seed)
    fmt = config.weights.expert_format
    shapes = {"gate_up": (held, c.hidden_size, 2 * width), "down": (held, width, c.hidden_size)}
    w = {}
    for name, shape in shapes.items():
        a = jnp.asarray(rng.normal(0, 0.02, shape), jnp.float32)
        w[name] = pallas_kernels.quantize(a, fmt, axis=-2) if fmt in pallas_kernels.FORMATS else a.astype(dtype)
    x = jnp.asarray(rng.normal(size=(rows, c.hidden_size)), dtype)
    k = c.num_experts_per_tok
    kernel = gemm_kernel(config, here, 1)
    fn = _repeated(
        lambda x, ids, wts, w: moe_local(x, ids, wts, w, kernel=kernel, platform=here, num_groups=c.num_experts)
    )
    features, times = [], []
    for share, spread in ROUTINGS:
        ids = routing(rows, k, c.num_experts, held, share, spread, rng)
        local = ids[ids < held]
        features.append([1.0, local.size, len(np.unique(local))])
        times.append(_best_us(fn, x, jnp.asarray(ids), jnp.full((rows, k), 1.0 / k, dtype), w))
    # Non-negative: no route or expert makes a call faster; where routing cannot move a feature
    # (every expert local: routes fixed) the fit leaves it at zero instead of extrapolating noise.
    coef, _ = scipy.optimize.nnls(np.array(features), np.array(times))
    return [float(v) for v in coef]


def layer_timer(config: Config, layout: Layout, ids: np.ndarray, seed: int = 0):
    """A compiled MoE layer of `layout` on the mesh for picks int[rows, k] (all rows): `_timer`'s function."""
    import jax
    import jax.numpy as jnp

    from moejax.launch.loading import load_params
    from moejax.model.transformer import layer_params
    from sharding import make_placement, with_placement

    cfg = with_placement(config, layout.name, layout.devices, layout.ep, layout.tp)
    placement = make_placement(cfg)
    params = load_params(cfg, placement, seed=seed)
    experts = layer_params(params, cfg.model.moe_layers[0], cfg.model)["moe"]["experts"]
    dtype = jnp.dtype(platform.run_dtype(cfg.engine.dtype))
    rows, k = ids.shape
    put = lambda a: jax.device_put(a, placement.sharding(("batch", None), a.shape))
    x = put(jnp.asarray(np.random.default_rng(seed).normal(size=(rows, cfg.model.hidden_size)), dtype))

    def layer(x, ids, wts, w):
        w = placement.gather_experts(w)  # a placement that moves weights gathers here
        return placement.moe(x, ids, wts, w)

    return _timer(_repeated(layer), x, put(jnp.asarray(ids)), put(jnp.full((rows, k), 1.0 / k, dtype)), experts)


def one_step(ids: np.ndarray, num_experts: int) -> Trace:
    """A trace of one decode step of one layer: the picks int[rows, k] a measurement ran."""
    return Trace(
        ids=ids[None, None],
        valid=np.ones((1, ids.shape[0]), bool),
        kind=np.array(["decode"]),
        layers=np.zeros(1, np.int32),
        num_experts=num_experts,
        model="calibration",
    )


# ----------------------------------------------------------------------------- filling the table


def ensure(table: CostTable, config: Config, trace: Trace, n: int, seed: int = 0) -> CostTable:
    """Measures every entry the simulation of `trace`'s decode steps on n devices needs and is missing.
    The placements' layers are timed round-robin, so that a burst of load on the shared host falls
    on all of them rather than on one."""
    c = config.model
    decode = trace.select(trace.kind == "decode")
    rng = np.random.default_rng(seed)
    order = eplb.contiguous(1, c.num_experts)
    layers = {}  # exchange key -> (layer timer, simulated expert phase of its picks in us)
    for layout in layouts(n):
        for rows in map(int, np.unique(padded_rows(decode, n))):
            xkey = f"{layout.name},{layout.ep},{layout.tp},{rows}"
            if xkey in table.exchange:
                continue
            ids = np.stack([rng.choice(c.num_experts, c.num_experts_per_tok, replace=False) for _ in range(rows)])
            calib = one_step(ids.astype(np.int32), c.num_experts)
            work = device_work(calib, layout, order, table.intermediate)
            key = f"{int(work.rows[0])},{work.width},{work.held}"
            if key not in table.compute_fit:
                table.compute_fit[key] = measure_compute(config, int(work.rows[0]), work.width, work.held, seed)
            base, per_route, per_expert = table.compute_fit[key]
            call = base + per_route * work.routes + per_expert * work.experts  # [1, 1, N]
            expert_phase = float(phase_us(call, table.concurrency)[0, 0])
            layers[xkey] = (layer_timer(config, layout, calib.ids[0, 0], seed), expert_phase)
    best = dict.fromkeys(layers, float("inf"))
    for _ in range(ROUNDS):
        for xkey, (once, _) in layers.items():
            best[xkey] = min(best[xkey], once())
    for xkey, (_, expert_phase) in layers.items():
        table.exchange[xkey] = best[xkey] - expert_phase
    return table


def ensure_slots(table: CostTable, config: Config, trace: Trace, n: int, spare_slots: int, seed: int = 0) -> CostTable:
    """The compute entries `ensure` leaves out for experts placed with `spare_slots` replicas: the
    placements that hold (E + spare) / ep slots per device."""
    c = config.model
    decode = trace.select(trace.kind == "decode")
    rng = np.random.default_rng(seed)
    order = np.concatenate([np.arange(c.num_experts), np.arange(spare_slots) % c.num_experts])[None]
    for layout in layouts(n):
        if layout.ep == 1 or layout.rows_stay_home or (c.num_experts + spare_slots) % layout.ep:
            continue
        for rows in map(int, np.unique(padded_rows(decode, n))):
            ids = np.stack([rng.choice(c.num_experts, c.num_experts_per_tok, replace=False) for _ in range(rows)])
            work = device_work(one_step(ids.astype(np.int32), c.num_experts), layout, order, table.intermediate)
            key = f"{int(work.rows[0])},{work.width},{work.held}"
            if key not in table.compute_fit:
                table.compute_fit[key] = measure_compute(config, int(work.rows[0]), work.width, work.held, seed)
    return table


def fit_non_moe(table: CostTable, measured_step_ms: float, trace: Trace, layout: Layout) -> float:
    """Sets the non-MoE term of `layout.devices` devices from one measured decode step time of
    `layout` on `trace`'s picks: measured minus the simulated MoE part. Returns it in microseconds."""
    decode = trace.select(trace.kind == "decode")
    moe_ms = simulate(decode, layout, eplb.contiguous(decode.ids.shape[1], decode.num_experts), table)["moe_ms"]
    rows = int(np.unique(-(-decode.valid.sum(axis=1) // layout.devices) * layout.devices)[0])
    table.non_moe[f"{layout.devices},{rows}"] = 1e3 * (measured_step_ms - moe_ms)
    return table.non_moe[f"{layout.devices},{rows}"]
