"""`convert`: a transformers directory -> an orbax checkpoint, one tensor at a time.

Each tensor is read from its memory-mapped safetensors file, cast, quantized if asked (by the
same single-device `Placement.place` a run would use, so 4-bit experts are bit-identical to
quantizing on load) and handed to the group writer before the next one is read.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from checkpoints.hf import iter_hf_tensors, read_hf_config
from checkpoints.manifest import Manifest
from checkpoints.orbax_io import named_specs, param_key, to_stored, write
from moejax.config import Config, EngineConfig, WeightsConfig
from moejax.model.params import param_dtype


def convert(hf_dir: str | Path, out: str | Path, *, expert_format: str = "bf16", dtype: str = "float32",
            progress: bool = False) -> Manifest:
    from sharding.placement import Placement

    model = read_hf_config(hf_dir)
    config = Config(model=model, weights=WeightsConfig(expert_format), engine=EngineConfig(dtype=dtype)).validate()
    placement = Placement(config)
    manifest = Manifest(model, dtype, expert_format)
    # disable=None: a bar only on a terminal.
    bar = tqdm(total=len(named_specs(manifest)[0]), desc="convert", disable=None if progress else True)

    def stream():
        for path, spec, array in iter_hf_tensors(hf_dir, model):
            key = param_key(path)
            yield key, to_stored(spec, placement.place(spec, array.astype(param_dtype(spec, dtype))), placement)
            bar.set_postfix_str(key[:40], refresh=False)
            bar.update()

    with bar:
        return write(out, manifest, stream())
