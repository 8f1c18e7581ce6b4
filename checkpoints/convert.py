"""`convert`: a transformers directory -> an orbax checkpoint, one tensor at a time.

Each tensor is read from its memory-mapped safetensors file (dequantized if published FP8 or
NVFP4), cast, quantized if asked (by the same `run_form` a run loads with, so 4-bit experts are
bit-identical to quantizing on load; experts published 4-bit stay as published) and handed to
the group writer before the next one is read.
"""

from __future__ import annotations

import sys
from pathlib import Path

from checkpoints.hf import expert_format as native_format
from checkpoints.hf import iter_hf_tensors, read_hf_config
from checkpoints.manifest import Manifest
from checkpoints.orbax_io import named_specs, param_key, to_stored, write
from checkpoints.placing import run_form
from moejax.config import Config, EngineConfig, WeightsConfig


class Progress:
    """A one-line bar redrawn in place on a terminal; silent when stderr is not one."""

    def __init__(self, total: int, enabled: bool, width: int = 30):
        self.total, self.done, self.width = total, 0, width
        self.enabled = enabled and sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            filled = self.width * self.done // self.total
            sys.stderr.write(f"\rconvert [{'#' * filled}{' ' * (self.width - filled)}] "
                             f"{self.done}/{self.total} {label[:40]:<40}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def convert(hf_dir: str | Path, out: str | Path, *, expert_format: str = "unquantized", dtype: str = "float32",
            progress: bool = False) -> Manifest:
    model = read_hf_config(hf_dir)
    expert_format = native_format(hf_dir, expert_format)
    Config(model=model, weights=WeightsConfig(expert_format), engine=EngineConfig(dtype=dtype)).validate()
    manifest = Manifest(model, dtype, expert_format)
    bar = Progress(len(named_specs(manifest)[0]), progress)

    def stream():
        for path, spec, array in iter_hf_tensors(hf_dir, model):
            key = param_key(path)
            # One K-slice: on disk, 4-bit values are independent of any placement.
            yield key, to_stored(spec, run_form(spec, array, dtype, expert_format), 1)
            bar.step(key)

    return write(out, manifest, stream())
