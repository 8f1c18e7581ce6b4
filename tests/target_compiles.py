"""Compiling the engine's programs for accelerator targets in worker processes.

A case names a model, a target (`moejax.base.targets`), its device count, a placement, a dtype, the
kernels and a page size; a worker (`python tests/target_compiles.py CASES.json`) compiles each
case's programs (`moejax.compiled.plan.programs`: decode step, decode block, prefill chunk) with the
target's own compiler and prints one JSON line per case. Workers run in parallel, one per core,
and an XLA abort (a failed check ends the process, no Python error) costs one case, not the run:
`run_cases` marks the case a dead worker was compiling and starts another worker on the rest.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import json
import os
import subprocess
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Widths no power of two divides past 8 (what small models have and Triton's blocks do not), for
# GQA and for MLA models; and widths that fill the TPU grouped GEMM's 128-lane tiles.
ODD_GQA = (("hidden_size", 40), ("moe_intermediate_size", 24), ("intermediate_size", 56), ("head_dim", 24))
ODD_MLA = (
    ("hidden_size", 40),
    ("moe_intermediate_size", 24),
    ("intermediate_size", 56),
    ("qk_nope_head_dim", 24),
    ("v_head_dim", 24),
    ("kv_lora_rank", 48),
    ("q_lora_rank", 40),
)
TILEABLE = (("hidden_size", 512), ("moe_intermediate_size", 2048))  # tensor-sliced on 8: K 256
# The kernel names of the paged-attention kernels' Pallas calls (`hlo.Instr.kernel`): JAX's ragged paged
# attention (TPU) and our Mosaic GPU one.
PAGED_KERNELS = ("ragged_paged_attention_kernel", "paged_attention_mgpu")
# The modules of Pallas's Triton backend (jax 0.11 deprecated it): a worker asked to compile as a jax
# without it finds none of them (`_without_triton`), so jax lowers GPU kernels with Mosaic GPU or not at all.
TRITON_MODULES = ("jax._src.pallas.triton", "jax.experimental.pallas.triton")


@dataclasses.dataclass(frozen=True)
class Case:
    model: str  # a preset, or "hf:FAMILY": the goldens' transformers model of a family
    target: str
    widths: tuple = ()  # (ModelConfig field, value) pairs replacing the model's
    devices: int = 1
    placement: str = "expert_sharded"
    dtype: str = "bfloat16"
    kernel: str = "auto"
    attention_kernel: str = "auto"
    expert_format: str = "unquantized"
    page_size: int = 0  # a paged cache of this page size (0: contiguous)
    programs: tuple = ("decode", "decode block", "prefill")
    triton: bool = True  # False: compiled as by a jax without Pallas's Triton backend

    @property
    def id(self) -> str:
        widths = f"-d{self.widths[0][1]}" if self.widths else ""
        pages = f"-pages{self.page_size}" if self.page_size else ""
        triton = "" if self.triton else "-notriton"
        return (
            f"{self.model}{widths}-{self.target}x{self.devices}-{self.placement}-{self.dtype}-{self.kernel}-"
            f"{self.expert_format}{pages}{triton}"
        )

    @property
    def process(self) -> tuple:
        """The cases one worker process may compile together: one GPU architecture (ptxas assembles
        a process's Mosaic GPU kernels for the first it met) and one jax (with or without Triton)."""
        from moejax.base import targets

        return targets.target(self.target).capability, self.triton


def model_config(case: Case):
    """The ModelConfig of a case: its model, with its widths."""
    from moejax.config import preset

    if case.model.startswith("hf:"):
        from hf_reference import hf_config

        from checkpoints.hf_config import from_hf_config

        model = from_hf_config(hf_config(case.model[3:]).to_dict())
    else:
        model = preset(case.model)
    return dataclasses.replace(model, **dict(case.widths))


def compile_case(case: Case) -> dict:
    """{program: {"compiled", "error", "pallas_calls" (their compilers: `hlo.PALLAS`), "paged_attention",
    "ragged_all_to_all", ...}} of one case."""
    from moejax.base import targets
    from moejax.compiled import hlo
    from moejax.compiled.plan import compile_program, programs
    from moejax.config import Config, EngineConfig, LayoutConfig, WeightsConfig
    from sharding import with_placement

    config = Config(
        model=model_config(case),
        layout=LayoutConfig(devices=case.devices),
        weights=WeightsConfig(case.expert_format),
        engine=EngineConfig(dtype=case.dtype),
        kernel=case.kernel,
        attention_kernel=case.attention_kernel,
    ).validate()
    config = with_placement(config, case.placement, case.devices)
    t = targets.target(case.target)
    placement, progs = programs(
        config,
        batch=8,
        context=64,
        prefill_chunk=32,
        platform=t.platform,
        devices=list(targets.devices(t.name, case.devices)),
        page_size=case.page_size,
    )
    out = {
        "kernel": placement.kernel,
        "attention_kernel": placement.attention_kernel,
        "decode_kernels": placement.decode.kernel,
        "programs": {},
    }
    for name in case.programs:
        jitted, args = progs[name]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled, seconds, error = compile_program(jitted, args, persist=False)
        text = compiled.as_text() if compiled else None
        calls = [r.instr for r in hlo.pallas_calls(text)] if text else []
        collectives = {r.instr.collective for r in hlo.collectives(text)} if text else set()
        out["programs"][name] = {
            "compiled": compiled is not None,
            "error": error,
            "seconds": round(seconds, 1),
            "deprecations": [
                f"{w.filename}:{w.lineno}: {w.message}"
                for w in caught
                if issubclass(w.category, (DeprecationWarning, FutureWarning))
            ],
            "pallas_calls": sorted({c.pallas for c in calls}),
            "paged_attention": any(c.kernel in PAGED_KERNELS for c in calls),
            "ragged_all_to_all": "ragged-all-to-all" in collectives,
        }
    return out


def run_cases(cases: list[Case], workers: int = 2) -> dict[str, dict]:
    """Every case compiled by `workers` worker processes -> {case id: result}; a case whose worker
    died compiling it gets {"aborted": the worker's last error lines}."""
    chunks = [cases[i::workers] for i in range(workers)]
    with ThreadPoolExecutor(workers) as pool:
        parts = pool.map(_run_chunk, [c for c in chunks if c])
    return {k: v for part in parts for k, v in part.items()}


def _run_chunk(cases: list[Case]) -> dict[str, dict]:
    """The cases of a chunk, in a worker process for each kind of process they need (`Case.process`)."""
    kinds = {c.process: None for c in cases}
    return {k: v for kind in kinds for k, v in _run_processes([c for c in cases if c.process == kind]).items()}


def _run_processes(cases: list[Case]) -> dict[str, dict]:
    results: dict[str, dict] = {}
    while len(results) < len(cases):
        todo = [c for c in cases if c.id not in results]
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump([dataclasses.asdict(c) for c in todo], f)
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
        flags = [] if cases[0].triton else ["--without-triton"]
        run = subprocess.run(
            [sys.executable, __file__, f.name, *flags], capture_output=True, text=True, env=env, cwd=ROOT
        )
        os.unlink(f.name)
        for line in run.stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                results[row["id"]] = row["result"]
        if run.returncode != 0 and len(results) < len(cases):  # the next case is the one it died on
            dead = next(c for c in todo if c.id not in results)
            why = [ln for ln in run.stderr.splitlines() if ln.startswith("F") or "Error" in ln][-3:]
            results[dead.id] = {"aborted": why or run.stderr.splitlines()[-3:]}
    return results


class _NoTriton(importlib.abc.MetaPathFinder):
    """Finds Pallas's Triton backend missing, as a jax without it would."""

    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in TRITON_MODULES):
            raise ModuleNotFoundError(f"No module named {name!r} (simulated: a jax without Triton)", name=name)
        return None


def _without_triton() -> None:
    """This process's jax without Pallas's Triton backend: before jax's first import of it."""
    if any(m in sys.modules for m in TRITON_MODULES):
        raise RuntimeError("Pallas's Triton backend is imported already")
    sys.meta_path.insert(0, _NoTriton())


def main(path: str, *flags: str) -> None:
    if "--without-triton" in flags:
        _without_triton()
    for raw in json.loads(Path(path).read_text()):
        case = Case(**{**raw, "programs": tuple(raw["programs"]), "widths": tuple(map(tuple, raw["widths"]))})
        print(json.dumps({"id": case.id, "result": compile_case(case)}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
