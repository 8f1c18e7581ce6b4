"""Quantized transformers checkpoints as published: which scheme a directory declares, and its
tensors read back as the floats (or 4-bit experts) they stand for.

Read:
- FP8 block-scaled (DeepSeek-V3/R1, GLM FP8; config.json `quantization_config` quant_method
  fp8 with `weight_block_size` [bo, bi]): a quantized linear has `weight` F8_E4M3 [out, in]
  and `weight_scale_inv` f32 [ceil(out/bo), ceil(in/bi)]; value = fp8 x the scale of its
  block. Dequantized on read.
- NVFP4 as NVIDIA ModelOpt exports it (`hf_quant_config.json` and/or quant_method modelopt,
  quant_algo NVFP4, group_size 16): `weight` uint8 [out, in/2], byte b holding the e2m1 codes of
  elements 2b (low nibble) and 2b + 1 (high nibble), as vLLM's and SGLang's loaders unpack
  it; `weight_scale` F8_E4M3 [out, in/16]; `weight_scale_2` f32 scalar; value = e2m1 x
  (weight_scale x weight_scale_2). Routed experts stay 4-bit (`PackedExperts`), every other
  linear is dequantized. `input_scale` (the activation scale of ModelOpt's W4A4 recipe) is not
  read: moejax runs 4-bit weights against activations in the run dtype (weight-only). Nor are
  the `k_scale` / `v_scale` of a `kv_cache_quant_algo` FP8 export: the KV cache is kept in the
  run dtype.
- MXFP4 (gpt-oss; quant_method mxfp4): experts' `*_blocks` uint8 [E, N, K/32, 16] (byte b of a
  block: elements 2b low, 2b + 1 high) and `*_scales` e8m0 [E, N, K/32]; stay 4-bit.

Which tensors are quantized is read from their dtypes; the declared scheme says which
quantized dtypes may appear. Anything else (another quant_method or algorithm, an integer or
8-bit tensor the scheme does not explain) is refused with one line naming it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import ml_dtypes
import numpy as np

from checkpoints.safetensors_io import SafetensorsDir
from moejax.base.errors import UsageError

FLOATS = ("F64", "F32", "F16", "BF16")
METHODS = ("fp8 (block-scaled)", "modelopt (NVFP4)", "mxfp4")
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


@dataclasses.dataclass(frozen=True)
class Scheme:
    """The quantization a directory declares: fp8 | nvfp4 | mxfp4 (None: plain floats)."""

    method: str
    block: tuple[int, int] = (128, 128)  # fp8: weight_block_size [out, in]

    @property
    def expert_format(self) -> str | None:
        """The 4-bit format routed experts are stored in (None: they are dequantized)."""
        return self.method if self.method in ("nvfp4", "mxfp4") else None


def _load_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise UsageError(f"{path}: not valid JSON") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: not a JSON object")
    return doc


def _modelopt(q: dict, where: str) -> Scheme:
    algo = q.get("quant_algo")
    if algo != "NVFP4":
        raise UsageError(f"{where}: ModelOpt quant_algo {algo!r} is not read (moejax reads NVFP4)")
    if q.get("group_size", 16) != 16:
        raise UsageError(f"{where}: NVFP4 group_size {q['group_size']} is not read (NVFP4 groups are 16)")
    return Scheme("nvfp4")


def read_scheme(directory: str | Path) -> Scheme | None:
    """The quantization `directory` declares in config.json's `quantization_config` or in
    ModelOpt's `hf_quant_config.json`; None for a plain checkpoint."""
    directory = Path(directory)
    config = directory / "config.json"
    q = _load_json(config).get("quantization_config") if config.is_file() else None
    where = f"{config}: quantization_config"
    if q is None and (directory / "hf_quant_config.json").is_file():
        where = str(directory / "hf_quant_config.json")
        q = _load_json(directory / "hf_quant_config.json").get("quantization")
        if not isinstance(q, dict):
            raise UsageError(f"{where}: no 'quantization' section")
        return _modelopt(q, where)
    if q is None:
        return None
    if not isinstance(q, dict):
        raise UsageError(f"{where} is not a mapping")
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise UsageError(
                f"{where}: fp8 without weight_block_size [out, in] (per-tensor FP8) is not read; "
                "moejax reads block-scaled FP8"
            )
        if q.get("fmt", "e4m3") != "e4m3":
            raise UsageError(f"{where}: fp8 fmt {q['fmt']!r} is not read (moejax reads e4m3)")
        return Scheme("fp8", tuple(block))
    if method == "modelopt":
        return _modelopt(q.get("quantization", q), where)
    if method == "mxfp4":
        return Scheme("mxfp4")
    raise UsageError(f"{where}: quant_method {method!r} is not read; moejax reads {', '.join(METHODS)}")


# ----------------------------------------------------------------------------- 4-bit experts


@dataclasses.dataclass(frozen=True)
class PackedExperts:
    """4-bit expert stacks [E, K, N] as a file holds them, quantized along K, values in the
    on-disk packing of `checkpoints.packing` (byte b: elements 2b, 2b + 1 along K).

    values: uint8 [E, K/2, N]; scales: e4m3 [E, K/16, N] (nvfp4) or e8m0 [E, K/32, N] (mxfp4);
    tensor_scale: f32 [E, 1, 1] (nvfp4; [E, 1, N] column-wise once gate and up are one
    matrix, `checkpoints.gate_up`) or None."""

    values: np.ndarray
    scales: np.ndarray
    tensor_scale: np.ndarray | None
    fmt: str

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, h, n = self.values.shape
        return (*lead, 2 * h, n)


def e2m1_pairs(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., M] (byte b: element 2b low nibble, 2b + 1 high) -> float32 [..., 2M]."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1)
    return E2M1[codes].reshape(*packed.shape[:-1], 2 * packed.shape[-1])


# ----------------------------------------------------------------------------- reading


class Tensors:
    """The tensors of a directory by name, each read as the float array it stands for.

    `get` dequantizes FP8 and NVFP4 linear weights (`X.weight` with its scales), reads plain
    floats as they are, and refuses any other dtype. `experts` returns 4-bit expert stacks
    whole (`PackedExperts`)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.st = SafetensorsDir(directory)
        self.scheme = read_scheme(directory)

    def __contains__(self, name: str) -> bool:
        return name in self.st

    def _dtype(self, name: str) -> str:
        if name not in self.st:
            raise UsageError(f"{self.directory}: tensor {name} is missing")
        return self.st.index[name][1]["dtype"]

    def _refuse(self, name: str, dtype: str) -> UsageError:
        declared = f"declares {self.scheme.method}" if self.scheme else "declares no quantization"
        return UsageError(
            f"{self.directory}: tensor {name} has dtype {dtype}, which moejax does not read here "
            f"(the checkpoint {declared})"
        )

    def get(self, name: str) -> np.ndarray:
        dtype = self._dtype(name)
        if dtype in FLOATS:
            return self.st.get(name)
        method = self.scheme.method if self.scheme else None
        if name.endswith(".weight") and method == "fp8" and dtype == "F8_E4M3":
            return self._fp8(name)
        if name.endswith(".weight") and method == "nvfp4" and dtype == "U8":
            return self._nvfp4(name[: -len(".weight")])
        raise self._refuse(name, dtype)

    def _scale(self, name: str, shape: tuple, what: str) -> np.ndarray:
        if name not in self.st:
            raise UsageError(f"{self.directory}: tensor {name} is missing ({what})")
        s = self.st.get(name)
        if tuple(s.shape) != tuple(shape):
            raise UsageError(
                f"{self.directory}: tensor {name} has shape {list(s.shape)}, expected {list(shape)} ({what})"
            )
        return s

    def _fp8(self, name: str) -> np.ndarray:
        """F8_E4M3 [out, in] x its block's weight_scale_inv -> float32 [out, in]."""
        w = self.st.get(name)
        (bo, bi), (o, i) = self.scheme.block, w.shape
        s = self._scale(
            name + "_scale_inv",
            (-(-o // bo), -(-i // bi)),
            f"one f32 scale per {bo}x{bi} block of {name} {list(w.shape)}",
        )
        step = np.repeat(np.repeat(s.astype(np.float32), bo, 0), bi, 1)[:o, :i]
        return w.astype(np.float32) * step

    def _nvfp4_parts(self, pre: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ModelOpt NVFP4 linear `pre`: (codes uint8 [out, in/2], scales e4m3 [out, in/16], f32 [])."""
        w = self.st.get(pre + ".weight")
        o, half = w.shape
        what = f"NVFP4 scales of {pre}.weight {list(w.shape)}"
        s = self._scale(pre + ".weight_scale", (o, 2 * half // 16), "one e4m3 scale per 16 values, " + what)
        if self._dtype(pre + ".weight_scale") != "F8_E4M3":
            raise UsageError(
                f"{self.directory}: tensor {pre}.weight_scale has dtype "
                f"{self._dtype(pre + '.weight_scale')}, expected F8_E4M3"
            )
        if pre + ".weight_scale_2" not in self.st:
            raise UsageError(f"{self.directory}: tensor {pre}.weight_scale_2 is missing (the f32 scale of {pre})")
        s2 = self.st.get(pre + ".weight_scale_2").astype(np.float32)
        if s2.size != 1:
            raise UsageError(
                f"{self.directory}: tensor {pre}.weight_scale_2 has shape {list(s2.shape)}, expected a scalar"
            )
        return w, s, s2.reshape(())

    def _nvfp4(self, pre: str) -> np.ndarray:
        """float32 [out, in]."""
        w, s, s2 = self._nvfp4_parts(pre)
        step = np.repeat(s.astype(np.float32) * s2, 16, axis=1)
        return e2m1_pairs(w) * step

    def packed(self, names: list[str]) -> bool:
        """Whether linears `names` (without `.weight`) are every one NVFP4 (else every one read as floats)."""
        dtypes = {self._dtype(n + ".weight") for n in names}
        if self.scheme is None or self.scheme.method != "nvfp4" or dtypes != {"U8"}:
            if "U8" in dtypes and len(dtypes) > 1:
                raise UsageError(f"{self.directory}: experts {names[0]}.. mix NVFP4 and unquantized weights")
            return False
        return True

    def experts(self, names: list[str]) -> np.ndarray | PackedExperts:
        """Linears `names` (one per expert, without `.weight`) -> [E, in, out]: floats, or
        `PackedExperts` when every one of them is NVFP4."""
        if not self.packed(names):
            return np.stack([self.get(n + ".weight").T for n in names])
        parts = [self._nvfp4_parts(n) for n in names]
        return PackedExperts(
            values=np.stack([w.T for w, _, _ in parts]),  # [E, K/2, N]: bytes pair K neighbours
            scales=np.stack([s.T for _, s, _ in parts]),
            tensor_scale=np.stack([s2 for _, _, s2 in parts]).reshape(-1, 1, 1),
            fmt="nvfp4",
        )

    def mxfp4_experts(self, name: str) -> PackedExperts:
        """gpt-oss `name_blocks` [E, N, K/32, 16] + `name_scales` [E, N, K/32] -> [E, K, N]."""
        blocks, scales = name + "_blocks", name + "_scales"
        for t in (blocks, scales):
            if self._dtype(t) != "U8":
                raise UsageError(f"{self.directory}: tensor {t} has dtype {self._dtype(t)}, expected U8")
        b = self.st.get(blocks)
        s = self._scale(scales, b.shape[:-1], f"one e8m0 scale per 32 values of {blocks} {list(b.shape)}")
        e, n, groups, nbytes = b.shape
        if nbytes != 16:
            raise UsageError(f"{self.directory}: tensor {blocks} has {nbytes} bytes per block, expected 16")
        values = b.reshape(e, n, groups * 16)  # [E, N, K/2]
        return PackedExperts(
            values=np.ascontiguousarray(values.transpose(0, 2, 1)),
            scales=np.ascontiguousarray(s.transpose(0, 2, 1)).view(ml_dtypes.float8_e8m0fnu),
            tensor_scale=None,
            fmt="mxfp4",
        )
