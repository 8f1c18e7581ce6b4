"""One run for a lent GPU: the issue's figures within a budget, as one JSON and one markdown file.

The parts, the most valuable figures first, each a process of its own given its share of the
time left (a part that fails, hangs or overruns is stopped and recorded, and the next one runs):

1. decode: `gpu_decode.py`, the 48-layer Qwen3-30B-A3B, experts bf16 and NVFP4, batches 1 and 64,
   decode tok/s against the bound the step's bytes and the copy bandwidth set;
2. grouped_gemm: `gpu_grouped_gemm.py`, every grouped GEMM this GPU and jax run (Mosaic GPU,
   Triton) against `ragged_dot` and the HBM bound, at 1, 8 and 64 tokens;
3. tune_tiles: `tune_tiles.py`, the decode kernels' candidate tiles timed; its entries go to
   tiles_tuned.json in the folder (merge them later: `tune_tiles.py --merge`);
4. pytest: `pytest -m gpu`, the goldens and kernels on the GPU.

Writes `results.json` and `results.md` (device, jax, git commit, date, then a table a part) to the
folder at the start and after every part; the measured parts' rows also go to `NAME.jsonl` as they
come, the tuner's to `tiles_tuned.json`, every part's output to `NAME.log`, so a run cut short keeps
what it measured.

    PYTHONPATH=. python benchmarks/lent_gpu.py OUT              # on an H100 / H200: 8 minutes at most
    PYTHONPATH=. python benchmarks/lent_gpu.py OUT --dry-run    # this CPU: interpreted, tiny shapes
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BUDGET_S = 480.0  # the 8 minutes on one H100 or H200
# Each part's weight in the split of the time left: the decode loads 61 GB of bf16 weights, then NVFP4's, and
# compiles a 48-layer step for each (by hand in 96e45e9, the bf16 load alone took 176 s on an H200).
WEIGHTS = {"decode": 5, "grouped_gemm": 2, "tune_tiles": 2, "pytest": 2}
# The measured parts' arguments: (on a GPU, the shapes; in a dry run, the scripts' smoke settings).
ARGS = {
    "decode": (
        ["--formats", "bf16", "nvfp4", "--batches", "1", "64"],
        ["--smoke", "--formats", "bf16", "nvfp4", "--batches", "1", "--new-tokens", "3", "--prompt-len", "8"],
    ),
    "grouped_gemm": (["--tokens", "1", "8", "64"], ["--smoke"]),
}
# Where each part's rows go, removed before it runs: the measured parts' JSON lines, the tuner's run
# (its entries and timings), pytest's output (a line a test).
ROWS = {
    "decode": "decode.jsonl",
    "grouped_gemm": "grouped_gemm.jsonl",
    "tune_tiles": "tiles_tuned.json",
    "pytest": "pytest.log",
}
# pytest -v's line of a test: its id (which may hold spaces) and its outcome.
OUTCOME = re.compile(r"^(\S+::.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
SUMMARY = re.compile(r"^=+ (.*\bin [\d.]+s.*) =+$")  # its last line: "38 skipped, 1351 deselected in 8.93s"
RESERVE_S = 5.0  # of the budget, kept for writing the results after the last part
# A 48-layer bf16 Qwen3-30B-A3B is 61 GB: more than jax's default 75% of an H100's 80 GB.
MEMORY = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}


def finite(value):
    """value with its NaNs (a figure this device's record lacks) as None: results.json is strict JSON."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


def run_part(part: str, dry_run: bool, rows_to: Path) -> None:
    """In a part's own process: its rows, one JSON line each, to `rows_to` as they are measured; the
    first line is {"about": ...}, the run's setting. A format of the decode that fails (memory, a
    compile) is one {"error"} line, and the next format runs."""
    import gpu_decode
    import gpu_grouped_gemm
    import jax

    argv = ARGS[part][1 if dry_run else 0]
    kind = jax.devices()[0].device_kind
    with rows_to.open("w") as out:

        def write(row: dict) -> None:
            out.write(json.dumps(finite(row)) + "\n")
            out.flush()

        if part == "grouped_gemm":
            args = gpu_grouped_gemm.parse_args(argv)
            _, hbm, peak = gpu_grouped_gemm.ceilings()
            shape = [args.experts, args.hidden, args.inter]
            write({"about": {"device": kind, "hbm_tb_s": hbm / 1e12, "bf16_tflops": peak / 1e12, "E, K, N": shape}})
            for row in gpu_grouped_gemm.rows(args):
                write(row)
            return
        args = gpu_decode.parse_args(argv)
        bandwidth = gpu_decode.copy_bandwidth(args.copy_mb << 20)
        model = gpu_decode.model_of(args)
        write({"about": {"device": kind, "copy_tb_s": bandwidth / 1e12, "layers": model.num_layers}})
        for fmt in args.formats:
            try:
                for row in gpu_decode.rows(argparse.Namespace(**{**vars(args), "formats": [fmt]}), bandwidth):
                    write(row)
            except Exception as e:  # the other format's figures still come
                write({"experts": fmt, "error": f"{type(e).__name__}: {gpu_grouped_gemm.one_line(e)}"})


def command(part: str, out: Path, dry_run: bool, budget_s: float) -> list[str]:
    """The part's command line."""
    if part == "pytest":
        # -vv: a line a test (the project's addopts has -q), so a stopped run still says which passed
        return [sys.executable, "-m", "pytest", "-m", "gpu", "-vv", "-p", "no:cacheprovider", str(REPO / "tests")]
    if part == "tune_tiles":
        # its own budget a little short of the part's, so it ends with its file written, not killed
        tuner = [sys.executable, str(HERE / "tune_tiles.py"), str(out / ROWS[part])]
        return tuner + ["--budget-s", f"{0.8 * budget_s:.0f}"] + (["--dry-run"] if dry_run else [])
    rows = ["--part", part, "--rows-to", str(out / ROWS[part])]
    return [sys.executable, str(Path(__file__).resolve()), str(out), *rows] + (["--dry-run"] if dry_run else [])


def run(part: str, out: Path, dry_run: bool, budget_s: float) -> dict:
    """Runs the part in its own process group for at most `budget_s` seconds -> its record: status
    ("ok", "failed (exit N): its last line", "over budget: stopped after N s"), seconds, command."""
    cmd = command(part, out, dry_run, budget_s)
    env = {
        **MEMORY,
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    (out / ROWS[part]).unlink(missing_ok=True)  # an earlier run's, in a folder used again
    t0 = time.monotonic()
    with (out / f"{part}.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # over budget, or this script stopped (SIGTERM, `main`): the part's group goes with it
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its children too (pytest's, the compilers')
                proc.wait()
    seconds = time.monotonic() - t0
    lines = (out / f"{part}.log").read_text(errors="replace").strip().splitlines()
    if code is None:
        status = f"over budget: stopped after {seconds:.0f} s"
    elif code == 0 or (part == "pytest" and code == 5):  # 5: no test selected
        status = "ok"
    else:
        status = f"failed (exit {code}): {lines[-1][:200] if lines else 'no output'}"
    return {"status": status, "seconds": round(seconds, 1), "command": " ".join(cmd)}


def rows_of(part: str, out: Path) -> tuple[dict, list[dict]]:
    """(about, rows) of a part's files in `out`, as far as they were written."""
    path = out / ROWS[part]
    if not path.exists():
        return {}, []
    if part == "pytest":
        outcomes, summary = {}, "none (stopped before the end)"
        for line in path.read_text(errors="replace").splitlines():
            if found := OUTCOME.match(line):
                outcomes[found[1]] = found[2].lower()
            elif found := SUMMARY.match(line):
                summary = found[1]
        counts = {o: sum(v == o for v in outcomes.values()) for o in sorted(set(outcomes.values()))}
        bad = [{"test": t, "outcome": o} for t, o in outcomes.items() if o in ("failed", "error")]
        return {**counts, "summary": summary}, bad
    if part == "tune_tiles":
        tuned = json.loads(path.read_text())
        rows = []
        for s in tuned["shapes"]:
            timed = [c for c in s["candidates"] if "us" in c]
            best = min(timed, key=lambda c: c["us"], default=None)
            current = s["candidates"][0] if s["candidates"] else {}  # the table's entry is tried first
            rows.append(
                {
                    **{f: s[f] for f in ("kernel", "product", "rows", "fmt")},
                    "table_us": current["us"] / tuned["copies"] if "us" in current else None,
                    "best_us": best["us"] / tuned["copies"] if best else None,
                    "best": " ".join(f"{k}={v}" for k, v in best["tiles"].items()) if best else "",
                    "timed": len(timed),
                    "not_run": len(s["candidates"]) - len(timed),
                    "note": s.get("over_budget", ""),
                }
            )
        return {"device": tuned["device"], "entries": ROWS[part]}, rows
    lines = [row for line in path.read_text().splitlines() if (row := json_line(line))]
    about = next((line["about"] for line in lines if "about" in line), {})
    return about, [line for line in lines if "about" not in line]


def json_line(line: str) -> dict | None:
    """A JSON line's dict; None for a line a stopped part left cut short."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def cell(v) -> str:
    """A value in a markdown table: floats to 3 significant figures or so, None empty."""
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 1 else f"{v:.3f}"
    return "" if v is None else str(v)


def markdown(results: dict) -> str:
    """The results as markdown: the run's setting, then each part's status, setting and table."""
    head = ["device", "jax", "commit", "date", "budget_s", "dry_run"]
    text = ["# moejax on a lent GPU", "", *(f"- {k}: {results[k]}" for k in head), ""]
    for name, part in results["parts"].items():
        text += [f"## {name}: {part['status']}" + (f", {part['seconds']} s" if "seconds" in part else ""), ""]
        if part.get("about"):
            text += [", ".join(f"{k} {cell(v)}" for k, v in part["about"].items()), ""]
        columns = list(dict.fromkeys(k for row in part.get("rows", []) for k in row))
        if columns:
            text += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            text += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in part["rows"]]
            text += [""]
    return "\n".join(text)


def save(results: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(finite(results), indent=2, allow_nan=False) + "\n")
    (out / "results.md").write_text(markdown(results))


def commit() -> str:
    """The checkout's commit; "unknown" where the copy has no git history or the machine no git."""
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
    except FileNotFoundError:
        return "unknown"
    if git.returncode != 0:
        return "unknown"
    return git.stdout.strip() + (" (with uncommitted changes)" if status.stdout.strip() else "")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the folder results.json, results.md and the parts' files go to")
    p.add_argument("--dry-run", action="store_true", help="this CPU: interpreted kernels, tiny shapes")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for all the parts together")
    p.add_argument("--part", choices=list(ARGS), help="(the script's own) run one measured part here")
    p.add_argument("--rows-to", type=Path, help="(with --part) the JSON-lines file its rows go to")
    args = p.parse_args(argv)
    if args.budget_s <= RESERVE_S:
        p.exit(2, f"lent_gpu: --budget-s must be more than {RESERVE_S:.0f} s, got {args.budget_s:g}\n")
    if args.part:
        run_part(args.part, args.dry_run, args.rows_to)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    # A part runs in a session of its own (so that its whole group can be stopped): stopping this
    # script must stop it too, not leave it holding the GPU.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    deadline = time.monotonic() + args.budget_s - RESERVE_S
    results = {
        "device": "not yet known (the parts report it)",
        "jax": importlib.metadata.version("jax"),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "budget_s": args.budget_s,
        "dry_run": args.dry_run,
        "parts": {name: {"status": "not started"} for name in WEIGHTS},
    }
    save(results, args.out)
    for i, name in enumerate(WEIGHTS):
        share = WEIGHTS[name] / sum(list(WEIGHTS.values())[i:])
        budget = share * (deadline - time.monotonic())
        stopped = None
        try:
            record = run(name, args.out, args.dry_run, budget) if budget > 1 else {"status": "over budget: not started"}
        except SystemExit as e:  # this script stopped from outside: the part's rows so far are still written
            record, stopped = {"status": "stopped: the script was terminated"}, e
        about, rows = rows_of(name, args.out)
        results["parts"][name] = {**record, "about": about, "rows": rows}
        if "device" in about and results["device"].startswith("not yet"):
            results["device"] = about["device"]
        save(results, args.out)
        print(f"{name}: {record['status']}", flush=True)
        if stopped:
            raise stopped


if __name__ == "__main__":
    main()
