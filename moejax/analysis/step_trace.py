"""`moejax trace`: Decode-Anatomy's method on a real run. Per device and MoE layer, the time of attention,
dispatch, expert GEMMs and combine of decode steps, read from `jax.profiler`'s own trace.

How the profiler's events are attributed:

- Which device: every XLA op event carries the device it ran for (`device_ordinal`; on CPU the
  devices are threads of one process, on a GPU each device is a plane of its own).
- Which part of the layer: an event names its HLO op; the compiled program's text gives each op
  the `jax.named_scope` path it came from. The model names `moe_layers` (the MoE layers' scan
  body), `attention`, `moe` (router and the placement's exchange) and `experts` (the local
  expert GEMMs). A `moe` op that starts before the middle (median start) of the layer's
  `experts` ops on that device is dispatch, one after it combine. Ops under none of these (norms, the shared expert,
  the dense layers, sampling) count only in the step total.
- Which layer: the MoE layers are iterations of one `lax.scan`, so the ops of its body run once
  per layer (nested loops', such as a grouped GEMM's, more often). On each device, layer j begins
  at the j-th run of the first op that runs exactly L times in the step, and every event belongs
  to the layer window it starts in: a segmentation by event time (an op XLA hoisted out of the
  loop counts for layer 0).
- Times: per (device, layer, part) the union of its events' intervals (ops of one device may run
  concurrently on CPU threads, and a loop's event contains its body's), so no time counts twice
  within a part; the step is the execution's span over every device. Each figure is the median
over the traced steps.

Decode-Anatomy's imbalance term is on the expert time: per layer the slowest device, the mean device and
slowest minus mean.
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import tempfile
from pathlib import Path

import jax
import numpy as np
from jax.profiler import ProfileData

from moejax.base.errors import UsageError
from moejax.compiled import hlo

PARTS = ("attention", "dispatch", "experts", "combine")


def profile_run(engine, prompts: list[list[int]], steps: int) -> tuple[ProfileData, dict[str, str]]:
    """(the profile of `engine.generate(prompts, steps + 1)`: its prefill chunks and `steps` decode
    steps, the compiled text of each step's program by module name, "jit_prefill" and
    "jit_decode_step"). A first run outside the trace compiles and warms everything."""
    block, engine.decode_block = engine.decode_block, 1  # a program per step: each run is one step
    try:
        engine.generate(prompts, steps + 1)
        with _capture(engine, "_prefill") as prefills, _capture(engine, "_decode") as decodes:
            with tempfile.TemporaryDirectory() as out:
                with jax.profiler.trace(out):
                    engine.generate(prompts, steps + 1)
                profile = ProfileData.from_file(str(next(Path(out).rglob("*.xplane.pb"))))
    finally:
        engine.decode_block = block
    texts = {}
    for module, calls in (("jit_prefill", prefills), ("jit_decode_step", decodes)):
        jitted, args, kwargs = calls[-1]  # lowered again from the shapes just run: a compile cache hit
        texts[module] = jitted.lower(*args, **kwargs).compile().as_text()
    return profile, texts


@contextlib.contextmanager
def _capture(engine, name: str):
    """While open, the engine's jitted step `name` records each call's (jitted, argument shapes, kwargs),
    so the program it ran can be lowered again for its text (the donated cache is gone by then)."""
    jitted, calls = getattr(engine, name), []
    # Uncommitted arrays (host inputs) go wherever the step puts them: no sharding of their own.
    spec = lambda x: (
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed else None)
        if isinstance(x, jax.Array)
        else x
    )

    def spy(*args, **kwargs):
        calls.append((jitted, jax.tree.map(spec, args), kwargs))
        return jitted(*args, **kwargs)

    setattr(engine, name, spy)
    try:
        yield calls
    finally:
        setattr(engine, name, jitted)


def op_scopes(hlo_text: str) -> dict[str, str]:
    """HLO op name -> its `op_name` path (named scopes included), from a compiled program's text."""
    return {i.name: i.scope for instrs in hlo.parse(hlo_text).comps.values() for i in instrs if i.scope}


def part_of(path: str) -> str | None:
    """attention | experts | moe (dispatch or combine, by time) | None, for a MoE layer's op path."""
    if "/moe_layers/" not in path:
        return None
    if "/experts/" in path or path.endswith("/experts"):
        return "experts"
    if "/attention/" in path or path.endswith("/attention"):
        return "attention"
    if "/moe/" in path or path.endswith("/moe"):
        return "moe"
    return None


def device_of(plane_name: str, stats: dict) -> int | None:
    if "device_ordinal" in stats:
        return int(stats["device_ordinal"])
    m = re.match(r"/device:[A-Z]+:(\d+)", plane_name)
    return int(m.group(1)) if m else None


def read_events(profile, module: str) -> list[tuple]:
    """(run_id, device, hlo_op, start_ns, end_ns) of every op event of jitted `module` (e.g.
    "jit_decode_step") in a `jax.profiler` ProfileData."""
    out = []
    for plane in profile.planes:
        for line in plane.lines:
            for e in line.events:
                stats = dict(e.stats)
                if stats.get("hlo_module") != module or "hlo_op" not in stats:
                    continue
                device = device_of(plane.name, stats)
                if device is not None:
                    out.append(
                        (stats.get("run_id", 0), device, stats["hlo_op"], e.start_ns, e.start_ns + e.duration_ns)
                    )
    return out


def _union_ns(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -np.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def attribute(events: list[tuple], scopes: dict[str, str], layers: int, devices: int) -> tuple[np.ndarray, np.ndarray]:
    """(parts_ms: float[runs, devices, layers, 4] in PARTS order, step_ms: float[runs]) from
    `read_events`' events of one module's executions."""
    by_run = collections.defaultdict(list)
    for ev in events:
        by_run[ev[0]].append(ev)
    runs = sorted(by_run, key=lambda r: min(ev[3] for ev in by_run[r]))
    parts = np.zeros((len(runs), devices, layers, len(PARTS)))
    steps = np.zeros(len(runs))
    for r, run in enumerate(runs):
        evs = by_run[run]
        steps[r] = (max(ev[4] for ev in evs) - min(ev[3] for ev in evs)) / 1e6
        for device in range(devices):
            mine = sorted(
                (ev[3], ev[4], ev[2], part)
                for ev in evs
                if ev[1] == device and (part := part_of(scopes.get(ev[2], ""))) is not None
            )
            for layer, spans in enumerate(_by_layer(mine, layers)):
                parts[r, device, layer] = [_union_ns(spans[p]) / 1e6 for p in PARTS]
    return parts, steps


def _by_layer(mine: list[tuple], layers: int) -> list[dict]:
    """One device's MoE-layer events (start, end, op, part), in time order -> per layer {part: [(start, end)]}.

    Layer j starts when an op that runs once per layer (one of the scan body's own, such as
    attention's) first runs for the j-th time; nested loops' ops fall in the window they run in."""
    seen = collections.defaultdict(list)
    for a, _, op, _ in mine:
        seen[op].append(a)
    once = [starts for starts in seen.values() if len(starts) == layers]
    bounds = np.min(once, axis=0) if once else np.zeros(layers)  # [layers]
    out = [{p: [] for p in (*PARTS, "moe")} for _ in range(layers)]
    for a, b, _, part in mine:
        out[max(0, int(np.searchsorted(bounds, a, side="right")) - 1)][part].append((a, b))
    for spans in out:
        # Dispatch comes before the expert GEMMs and combine after; split at the middle of the
        # layer's expert events (a few of theirs, constants, XLA schedules early).
        split = np.median([a for a, _ in spans["experts"]]) if spans["experts"] else np.inf
        spans["dispatch"] = [s for s in spans["moe"] if s[0] < split]
        spans["combine"] = [s for s in spans["moe"] if s[0] >= split]
    return out


def report(parts: np.ndarray, steps: np.ndarray, moe_layers: list[int]) -> dict:
    """`moejax trace --json`'s object from `attribute`'s arrays: per device, layer and part the
    median over the executions (one preempted thread on a shared host does not move it)."""
    mean = np.median(parts, axis=0)  # [devices, layers, 4]
    experts = mean[:, :, PARTS.index("experts")]  # [devices, layers]
    layers = []
    for i, layer in enumerate(moe_layers):
        slowest = int(experts[:, i].argmax())
        layers.append(
            {
                "layer": int(layer),
                "slowest_ms": float(experts[slowest, i]),
                "mean_ms": float(experts[:, i].mean()),
                "imbalance_ms": float(experts[slowest, i] - experts[:, i].mean()),
                "slowest_device": slowest,
                "devices": [
                    {"device": d, **{f"{p}_ms": float(mean[d, i, j]) for j, p in enumerate(PARTS)}}
                    for d in range(mean.shape[0])
                ],
            }
        )
    return {
        "step_ms": float(np.median(steps)),
        "steps": int(len(steps)),
        "layers": layers,
        "imbalance_ms": float(sum(entry["imbalance_ms"] for entry in layers)),
    }


def table(doc: dict) -> str:
    """Decode-Anatomy's table per MoE layer, then each device's parts."""
    lines = [
        f"decode step {doc['step_ms']:.3f} ms (median of {doc['steps']} traced steps); expert time per MoE layer:",
        "layer  slowest ms  mean ms  slowest-mean ms  slowest device",
    ]
    for entry in doc["layers"]:
        lines.append(
            f"{entry['layer']:5d}  {entry['slowest_ms']:10.3f}  {entry['mean_ms']:7.3f}  "
            f"{entry['imbalance_ms']:15.3f}  {entry['slowest_device']:14d}"
        )
    lines.append(f"sum of slowest - mean over layers: {doc['imbalance_ms']:.3f} ms")
    lines.append("layer  device  attention ms  dispatch ms  experts ms  combine ms")
    for entry in doc["layers"]:
        for d in entry["devices"]:
            lines.append(
                f"{entry['layer']:5d}  {d['device']:6d}  {d['attention_ms']:12.3f}  {d['dispatch_ms']:11.3f}"
                f"  {d['experts_ms']:10.3f}  {d['combine_ms']:10.3f}"
            )
    return "\n".join(lines)


def trace_engine(engine, prompts: list[list[int]], steps: int, prefill: bool = False) -> dict:
    """`moejax trace --json`'s object: the layout, then `report` of the decode steps (and of the
    prefill chunks under "prefill")."""
    profile, texts = profile_run(engine, prompts, steps)
    c, placement = engine.c, engine.placement

    def one(module: str) -> dict:
        parts, step_ms = attribute(
            read_events(profile, module), op_scopes(texts[module]), len(c.moe_layers), placement.devices
        )
        return report(parts, step_ms, list(c.moe_layers))

    doc = {
        "placement": placement.name,
        "ep": placement.ep,
        "tp": placement.tp,
        "devices": placement.devices,
        "routing": engine.config.engine.routing,
        "requests": len(prompts),
        **one("jit_decode_step"),
    }
    if prefill:
        doc["prefill"] = one("jit_prefill")
    return doc


def load(path: str) -> dict:
    """A saved `moejax trace --json` report."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"cannot read step trace {path}: {getattr(e, 'strerror', None) or e}") from None
    missing = {"placement", "ep", "tp", "devices", "routing", "steps", "step_ms", "imbalance_ms", "layers"} - set(doc)
    if missing:
        raise UsageError(f"{path} is not a `moejax trace --json` report: no {', '.join(sorted(missing))}")
    return doc
