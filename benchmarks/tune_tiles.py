"""Times candidate tiles of the decode kernels on this GPU and writes tile-table entries that say so.

For each kernel with a tile-table key that runs here (`catalog.Kernel.why_not`): `pick_gemm`, the
experts by pick (gate|up [E, 2048, 1536] with SwiGLU, down [E, 768, 2048]; bf16 and NVFP4), and
`fused_linear`, the dense products (q|k|v [2048, 5120] with the norms and rotary, the output
projection [4096, 2048] with the residual, the router [2048, 128] f32), at Qwen3-30B-A3B's decode
shapes: 1, 64, then 8 rows (tokens). Each candidate tile valid per the kernel's own check (a
tracing that raises ValueError is not one) and the table's current entry are timed; the fastest
becomes an entry of `pallas_kernels/tiles.json`'s format whose "from" is "timed on DEVICE (...),
DATE", and `tiles.lookup` takes it as it stands.

A candidate's time is that of one program of COPIES calls (the median of REPS runs) over COPIES:
each call reads weights of its own (a copy of the dense weight; other experts of the one stack), so
they come from HBM as in a 48-layer step, not from L2 (all but the router's 1 MB), and the calls
share one dispatch.

    python benchmarks/tune_tiles.py OUT.json                  # on a GPU: the entries, in OUT.json
    python benchmarks/tune_tiles.py OUT.json --write          # ... merged into pallas_kernels/tiles.json too
    python benchmarks/tune_tiles.py --merge OUT.json          # a GPU run's OUT.json, merged here later
    python benchmarks/tune_tiles.py OUT.json --dry-run        # CPU: interpreted, tiny shapes, never merged

OUT.json is rewritten after every shape, so a run cut short keeps the shapes it finished; with
`--budget-s` the run starts no candidate past its budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import moejax  # noqa: F401  (before jax: it starts jax on this host's platform, quietly)

# isort: split
import jax
import jax.numpy as jnp
import numpy as np
from gpu_decode import SMOKE
from gpu_grouped_gemm import median_seconds, one_line

import pallas_kernels as pk
from moejax.config import preset
from moejax.model.layers import silu_glu
from pallas_kernels import catalog, gmm_picks, linear, tiles

# Calls a timed program makes, each on weights of its own: 8 stream 130-400 MB at these shapes, past
# the 50 MB L2; each is a call site compiled on its own, so more would cost compile time.
COPIES = 8
REPS = 10  # timed runs of that program (median)
ROWS = (1, 64, 8)  # batch 1 first: the step the first figure is
DRY_RUN = "dry-run"  # a dry run's entries' "from" begins so: tiles.json's origins never do
KEY = ("rows", "k", "n", "fmt")  # the fields a table entry of a shape is matched by (`tiles._entry`)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One call to tune: `kernel` (its tile-table key) for `rows` tokens times a [k, n] weight in
    `fmt`; `product` names which of a layer's products it is."""

    kernel: str
    product: str
    rows: int
    k: int
    n: int
    fmt: str


def shapes(model, rows: tuple[int, ...]) -> list[Shape]:
    """The decode calls of `model` (a ModelConfig) worth tuning, the most used first at each row count."""
    d, dh = model.hidden_size, model.head_dim
    out = []
    for r in rows:
        for fmt in ("bf16", "nvfp4"):
            out.append(Shape("pick_gemm", "gate_up", r, d, 2 * model.moe_intermediate_size, fmt))
            out.append(Shape("pick_gemm", "down", r, model.moe_intermediate_size, d, fmt))
        out.append(Shape("fused_linear", "qkv", r, d, (model.num_heads + 2 * model.num_kv_heads) * dh, "bf16"))
        out.append(Shape("fused_linear", "out", r, model.num_heads * dh, d, "bf16"))
        out.append(Shape("fused_linear", "router", r, d, model.num_experts, "f32"))
    return out


def candidates(shape: Shape, kind: str, small: bool) -> list[dict]:
    """A few tiles of each size the kernel's blocks take (powers of two), first the table's entry for
    the shape on device `kind` (as it stands, before the fill rule narrows it); `small`: the first
    two only (a dry run's)."""
    current = tiles.lookup(shape.kernel, (kind, 0), rows=shape.rows, k=shape.k, n=shape.n, fmt=shape.fmt)
    if shape.kernel == "pick_gemm":  # a chunk of 16 picks holds an expert's picks at these batches
        grid = [
            dict(tm=16, tn=tn, tk=tk, num_warps=4, num_stages=3)
            for tn, tk in itertools.product((32, 64, 128), (64, 128, 256))
        ]
    else:  # the rows' block: their power of two, 16 to 64 (`linear_segments.block`); at most 64 columns a
        # program: 128 leaves the router one program and the output projection 16, on 132 SMs; K whole
        # or split in 4 or 16 slices of whole K tiles (the split-K that fills the SMs at batch 1)
        m = min(64, max(16, tiles.pow2(shape.rows)))
        grid = [
            dict(n=n, k=k, m=m, num_warps=4, num_stages=4, splits=splits)
            for n, k, splits in itertools.product((16, 32, 64), (64, 128, 256), (1, 4, 16))
            if shape.k % (k * splits) == 0
        ]
    unique = [current] + [t for t in grid if t != current]
    return unique[:2] if small else unique


def pick_gemm_program(shape: Shape, model, copies: int, interpret: bool) -> Callable[[dict], Callable]:
    """tiles -> a call running `copies` pick_gemms of the shape, each on other experts' weights."""
    experts, topk = model.num_experts, model.num_experts_per_tok
    gated = shape.product == "gate_up"
    w = jax.random.normal(jax.random.key(0), (experts, shape.k, shape.n), jnp.bfloat16) / shape.k**0.5
    rhs = w if shape.fmt == "bf16" else pk.quantize_experts(w, shape.fmt, gated=gated)  # as loaded for a run
    rng = np.random.default_rng(0)
    picks = np.stack([rng.choice(experts, topk, replace=False) for _ in range(shape.rows)]).ravel()
    ids = [jnp.asarray((picks + i * topk) % experts, jnp.int32) for i in range(copies)]  # each call its own experts
    lhs = jax.random.normal(jax.random.key(1), (shape.rows if gated else picks.size, shape.k), jnp.bfloat16)
    call = functools.partial(
        gmm_picks.pick_gemm,
        k=topk,
        group_offset=0,
        out_dtype=jnp.bfloat16,
        epilogue=(None, None, silu_glu) if gated else None,
        rows_are_picks=not gated,
        interpret=interpret,
    )

    def program(chosen: dict) -> Callable:
        run = jax.jit(lambda lhs, rhs, ids: [call(lhs, rhs, i, tiles=gmm_picks.Tiles(**chosen)) for i in ids])
        return lambda: run(lhs, rhs, ids)

    return program


def fused_linear_program(shape: Shape, model, copies: int, interpret: bool) -> Callable[[dict], Callable]:
    """tiles -> a call running `copies` fused_linear calls of the shape as a decode step makes them
    (`moejax/model/projections.py`), each on a copy of its weights."""
    m, k, dh = shape.rows, shape.k, model.head_dim
    dtype = jnp.float32 if shape.fmt == "f32" else jnp.bfloat16
    keys = iter(jax.random.split(jax.random.key(0), 3))
    x = jax.random.normal(next(keys), (m, k), jnp.bfloat16)
    norm = jnp.ones((k,), jnp.bfloat16)
    if shape.product == "qkv":
        widths = (model.num_heads * dh, model.num_kv_heads * dh, model.num_kv_heads * dh)
        angles = jax.random.uniform(next(keys), (m, dh // 2), jnp.float32)
        kw = dict(
            norm=norm,
            head_dim=dh,
            head_norms=(jnp.ones((dh,), jnp.bfloat16),) * 2 + (None,),
            rope=(jnp.cos(angles), jnp.sin(angles)),
            rotate=(True, True, False),
            out_dtype=jnp.bfloat16,
        )
    elif shape.product == "out":
        widths, kw = (shape.n,), dict(residual=jax.random.normal(next(keys), (m, shape.n), jnp.bfloat16))
    else:  # the router: its normed rows are the experts' too
        widths, kw = (shape.n,), dict(norm=norm, normed=True)
    weights = [
        tuple(jax.random.normal(jax.random.key(100 * i + j), (k, n), dtype) / k**0.5 for j, n in enumerate(widths))
        for i in range(copies)
    ]

    def program(chosen: dict) -> Callable:
        t = linear.Tiles(**chosen)
        run = jax.jit(lambda x, ws: [linear.fused_linear(x, w, tiles=t, interpret=interpret, **kw) for w in ws])
        return lambda: run(x, weights)

    return program


PROGRAMS = {"pick_gemm": pick_gemm_program, "fused_linear": fused_linear_program}


def tune(shape: Shape, program, kind: str, small: bool, deadline: float, reps: int) -> tuple[list[dict], bool]:
    """Each candidate's row ({"tiles", "us"} or {"tiles", "skipped" or "error"}), and whether every
    candidate was tried before `deadline` (time.monotonic())."""
    timed = []
    for chosen in candidates(shape, kind, small):
        if time.monotonic() > deadline:
            return timed, False
        call = program(chosen)
        try:
            jax.eval_shape(call)
        except ValueError as e:  # the kernel's own check refuses these tiles for the shape
            timed.append({"tiles": chosen, "skipped": one_line(e)})
            continue
        try:
            timed.append({"tiles": chosen, "us": median_seconds(call, reps=reps) * 1e6})
        except Exception as e:  # a candidate that fails to compile or run leaves the others' timings
            timed.append({"tiles": chosen, "error": f"{type(e).__name__}: {one_line(e)}"})
    return timed, True


def entry(shape: Shape, best: dict, tried: int, copies: int, origin: str) -> dict:
    """The table entry of `shape`'s fastest tiles (`best`, of `tried` timed candidates)."""
    us = best["us"] / copies
    return {
        "rows": shape.rows,
        "k": shape.k,
        "n": shape.n,
        "fmt": shape.fmt,
        "tiles": best["tiles"],
        "from": origin.format(detail=f"{shape.product}: {us:.1f} us a call, the fastest of {tried} candidates"),
    }


def merge(found: dict) -> int:
    """Merges a run's entries ({kernel: {device kind: [entries]}}) into tiles.json, each replacing
    the device's entry of the same rows, K, N and format; returns how many were merged."""
    table = json.loads(tiles.TABLE.read_text())
    merged = 0
    for kernel, devices in found.items():
        for kind, entries in devices.items():
            keys = {tuple(e.get(f) for f in KEY) for e in entries}
            kept = [e for e in table[kernel].get(kind, []) if tuple(e.get(f) for f in KEY) not in keys]
            table[kernel][kind] = kept + entries
            merged += len(entries)
    tiles.TABLE.write_text(json.dumps(table, indent=2) + "\n")
    return merged


def save(run: dict, out: Path) -> None:
    """The run so far to `out`, whole or not at all: a run stopped while writing leaves the last one."""
    part = out.with_name(out.name + ".part")
    part.write_text(json.dumps(run, indent=2) + "\n")
    part.replace(out)


def refuse(message: str) -> None:
    print(f"tune_tiles: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", type=Path, help="the JSON file the run's timings and entries go to")
    p.add_argument("--write", action="store_true", help="merge the entries into pallas_kernels/tiles.json")
    p.add_argument("--merge", type=Path, help="merge a GPU run's OUT.json into pallas_kernels/tiles.json; time nothing")
    p.add_argument(
        "--dry-run", action="store_true", help="this machine: interpreted, tiny shapes, the first rows, 2 candidates"
    )
    p.add_argument("--budget-s", type=float, default=float("inf"), help="start no candidate past this many seconds")
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    args = p.parse_args(argv)
    if args.dry_run and (args.write or args.merge):
        refuse("a dry run's entries are not timings; --write and --merge take a GPU run's")
    if (args.out is None) == (args.merge is None):
        refuse("give OUT.json to tune into, or --merge OUT.json of an earlier run")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        run = json.loads(args.merge.read_text())
        if run["dry_run"]:
            refuse(f"{args.merge} is a dry run's; its entries are not timings")
        print(f"merged {merge(run['entries'])} entries into {tiles.TABLE}")
        return
    start = time.monotonic()
    record = catalog.kernel(catalog.DECODE, "interpret_triton" if args.dry_run else "triton")
    refusal = record.why_not(jax.default_backend(), jax.devices()[0])
    if refusal:
        refuse(
            f"the decode kernels cannot run here: {refusal}"
            + ("" if args.dry_run else "; --dry-run runs them interpreted")
        )
    kind, today = jax.devices()[0].device_kind, datetime.datetime.now(datetime.UTC).date().isoformat()
    model = preset("qwen3-moe-30b-a3b")
    copies, reps = COPIES, REPS
    origin = f"timed on {kind} ({{detail}}), {today}"
    if args.dry_run:  # the benchmark's smoke model, one call a program
        model, copies, reps = dataclasses.replace(model, **SMOKE), 1, 1
        origin = f"{DRY_RUN}: interpreted on {kind} at tiny shapes ({{detail}}), {today}; not a timing"
    run = {"device": kind, "date": today, "dry_run": args.dry_run, "copies": copies, "entries": {}, "shapes": []}
    save(run, args.out)
    built = {}
    for shape in shapes(model, tuple(args.rows[:1] if args.dry_run else args.rows)):
        key = (shape.kernel, shape.product, shape.k, shape.n, shape.fmt)
        if key not in built:  # one set of weights for every row count
            built[key] = PROGRAMS[shape.kernel](shape, model, copies, interpret=args.dry_run)
        timed, finished = tune(shape, built[key], kind, args.dry_run, start + args.budget_s, reps)
        result = {**dataclasses.asdict(shape), "candidates": timed}
        fastest = min((t for t in timed if "us" in t), key=lambda t: t["us"], default=None)
        if not finished:
            result["over_budget"] = f"started no candidate past {args.budget_s:.0f} s"
        elif fastest is not None:
            found = entry(shape, fastest, sum("us" in t for t in timed), copies, origin)
            run["entries"].setdefault(shape.kernel, {}).setdefault(kind, []).append(found)
            result["entry"] = found
        run["shapes"].append(result)
        save(run, args.out)
        best = f"{fastest['tiles']} {fastest['us'] / copies:.1f} us" if fastest else "none ran"
        print(
            f"{shape.kernel} {shape.product} rows {shape.rows} {shape.fmt}: {best}"
            + (" (over budget)" if not finished else "")
        )
        if not finished:
            break
    if args.write:
        print(f"merged {merge(run['entries'])} entries into {tiles.TABLE}")


if __name__ == "__main__":
    main()
