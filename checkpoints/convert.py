"""`convert`: a transformers directory -> an orbax checkpoint, one tensor at a time.

Each tensor is read from its memory-mapped safetensors file (dequantized if published FP8 or
NVFP4), cast, quantized if asked (by the same `host_form` a run loads with, layer by layer, so 4-bit experts are
bit-identical to quantizing on load; experts published 4-bit stay as published) and handed to
the group writer before the next one is read.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from checkpoints.hf import expert_format as native_format
from checkpoints.hf import iter_hf_tensors, read_hf_config
from checkpoints.manifest import Manifest
from checkpoints.orbax_io import named_specs, param_key, to_stored, write
from checkpoints.placing import host_tensor
from moejax.config import Config, EngineConfig, WeightsConfig


def convert(
    hf_dir: str | Path,
    out: str | Path,
    *,
    expert_format: str = "unquantized",
    dtype: str = "float32",
    progress: bool = False,
) -> Manifest:
    model = read_hf_config(hf_dir)
    expert_format = native_format(hf_dir, expert_format)
    Config(model=model, weights=WeightsConfig(expert_format), engine=EngineConfig(dtype=dtype)).validate()
    manifest = Manifest(model, dtype, expert_format)
    # disable=None: a bar only on a terminal.
    bar = tqdm(total=len(named_specs(manifest)[0]), desc="convert", disable=None if progress else True)

    def stream():
        for path, spec, source in iter_hf_tensors(hf_dir, model):
            key = param_key(path)
            # One K-slice: on disk, 4-bit values are independent of any placement.
            yield key, to_stored(spec, host_tensor(spec, source, dtype, expert_format), 1)
            bar.set_postfix_str(key[:40], refresh=False)
            bar.update()

    with bar:
        return write(out, manifest, stream())
