"""Lazy, tensor-by-tensor reading of `.safetensors` files into numpy (bfloat16 included).

The `safetensors` numpy backend cannot represent bfloat16; the format is simple enough
(8-byte header length, JSON header, raw little-endian buffer) to memory-map directly, which
also keeps peak memory at one tensor.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from moejax.base.errors import UsageError

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsDir:
    """All tensors of the `*.safetensors` files in a directory, by name, read on demand."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.index: dict[str, tuple[Path, dict, int]] = {}
        index_file = self.directory / "model.safetensors.index.json"
        if index_file.is_file():
            files = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
            missing = [f for f in files if not (self.directory / f).is_file()]
            if missing:
                raise UsageError(f"{self.directory}: shard {missing[0]} listed in {index_file.name} is missing")
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not files:
            raise UsageError(f"{self.directory}: no .safetensors files")
        for name in files:
            self._read_header(self.directory / name)

    def _read_header(self, path: Path) -> None:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise UsageError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise UsageError(f"{path}: truncated safetensors file (header of {n} bytes, file of {size})")
            try:
                header = json.loads(f.read(n))
            except json.JSONDecodeError:
                raise UsageError(f"{path}: corrupted safetensors header") from None
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            if meta["data_offsets"][1] + 8 + n > size:
                raise UsageError(f"{path}: truncated safetensors file (tensor {key} runs past the end)")
            self.index[key] = (path, meta, 8 + n)

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def keys(self):
        return self.index.keys()

    def get(self, name: str) -> np.ndarray:
        if name not in self.index:
            raise UsageError(f"{self.directory}: tensor {name} is missing")
        path, meta, base = self.index[name]
        if meta["dtype"] not in DTYPES:
            raise UsageError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        start, end = meta["data_offsets"]
        dtype = np.dtype(DTYPES[meta["dtype"]])
        array = np.memmap(path, dtype=dtype, mode="r", offset=base + start, shape=((end - start) // dtype.itemsize,))
        return np.asarray(array).reshape(meta["shape"])
