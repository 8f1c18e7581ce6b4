"""Quantized checkpoints as published, written by the tests from a tiny random transformers
model: FP8 block-scaled (DeepSeek / GLM releases) and NVFP4 as NVIDIA ModelOpt exports it.

Each writer quantizes the tensors of a `save_pretrained` directory (on-disk names: one tensor per
expert) in place, and returns the transformers model loaded from the weights the new files
stand for (dequantized): the reference.
Written with numpy, ml_dtypes and torch only (no moejax code), so the tests check moejax's
reading against an independent writing of the formats.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

E4M3_MAX, E2M1_MAX = 448.0, 6.0


def quantized_linears(tensors: dict) -> list[str]:
    """Linear weights a published checkpoint quantizes: not norms, embeddings, the LM head or
    the router (DeepSeek-V3's FP8 release keeps these in bf16)."""
    keep = ("norm", "embed_tokens", "lm_head", "mlp.gate.", "router")
    return [n for n, t in tensors.items() if n.endswith(".weight") and t.ndim == 2 and not any(k in n for k in keep)]


def _read(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _save(directory: Path, tensors: dict, dequantized: dict, quantization_config: dict):
    """Writes the quantized tensors over `directory`'s; returns the reference model, loaded
    by transformers from `dequantized` (the float tensors the files stand for)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    reference = directory.parent / f"{directory.name}-dequantized"
    reference.mkdir()
    shutil.copy(directory / "config.json", reference / "config.json")
    save_file({k: v.contiguous() for k, v in dequantized.items()}, str(reference / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"quantization_config": quantization_config}))
    return transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()


def fp8_block(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """w: float32 [out, in] -> (e4m3 [out, in], f32 scale_inv [ceil(out/bo), ceil(in/bi)])."""
    (bo, bi), (o, i) = block, w.shape
    padded = np.zeros((-(-o // bo) * bo, -(-i // bi) * bi), np.float32)
    padded[:o, :i] = w
    tiles = padded.reshape(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi)
    scale = np.maximum(np.abs(tiles).max(axis=(1, 3)), 1e-12) / E4M3_MAX
    step = np.repeat(np.repeat(scale, bo, 0), bi, 1)[:o, :i]
    return (w / step).astype(ml_dtypes.float8_e4m3fn), scale.astype(np.float32)


def fp8_dequantize(q: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    (bo, bi), (o, i) = block, q.shape
    return q.astype(np.float32) * np.repeat(np.repeat(scale, bo, 0), bi, 1)[:o, :i]


def write_fp8(directory: Path, block=(128, 128)):
    import torch

    tensors = _read(directory)
    dequantized = dict(tensors)
    for name in quantized_linears(tensors):
        q, scale = fp8_block(tensors[name].numpy(), block)
        dequantized[name] = torch.from_numpy(fp8_dequantize(q, scale, block))
        tensors[name] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = torch.from_numpy(scale)
    return _save(
        directory,
        tensors,
        dequantized,
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)},
    )


def nvfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ModelOpt's NVFP4 of w: float32 [out, in] -> (uint8 [out, in/2] (byte b: elements 2b low,
    2b + 1 high), e4m3 [out, in/16], f32 weight_scale_2 [])."""
    o, i = w.shape
    scale_2 = np.float32(np.abs(w).max() / (E4M3_MAX * E2M1_MAX))
    blocks = w.reshape(o, i // 16, 16)
    scale = (np.abs(blocks).max(-1) / E2M1_MAX / scale_2).astype(ml_dtypes.float8_e4m3fn)
    step = scale.astype(np.float32)[..., None] * scale_2
    codes = (
        np.clip(blocks / np.where(step > 0, step, 1), -E2M1_MAX, E2M1_MAX)
        .astype(ml_dtypes.float4_e2m1fn)
        .view(np.uint8)
        .reshape(o, i)
        & 0xF
    )
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), scale, np.array(scale_2, np.float32)


def nvfp4_dequantize(packed: np.ndarray, scale: np.ndarray, scale_2: np.ndarray) -> np.ndarray:
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)
    values = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return values * np.repeat(scale.astype(np.float32) * scale_2, 16, axis=1)


def write_nvfp4(directory: Path, exclude: tuple[str, ...] = ()):
    """ModelOpt's export: hf_quant_config.json plus config.json's quantization_config; the
    linears named in `exclude` (glob patterns, as exclude_modules) stay unquantized."""
    import fnmatch

    import torch

    tensors = _read(directory)
    dequantized = dict(tensors)
    for name in quantized_linears(tensors):
        pre = name[: -len(".weight")]
        if any(fnmatch.fnmatch(pre, pat) for pat in exclude):
            continue
        packed, scale, scale_2 = nvfp4(tensors[name].numpy())
        dequantized[name] = torch.from_numpy(nvfp4_dequantize(packed, scale, scale_2))
        tensors[name] = torch.from_numpy(packed)
        tensors[pre + ".weight_scale"] = torch.from_numpy(scale.view(np.uint8)).view(torch.float8_e4m3fn)
        tensors[pre + ".weight_scale_2"] = torch.from_numpy(scale_2)
        tensors[pre + ".input_scale"] = torch.tensor(1.0)
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": list(exclude)}
    (directory / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt"}, "quantization": quant})
    )
    return _save(directory, tensors, dequantized, {"quant_method": "modelopt", **quant})


def mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OCP MXFP4 of w: float32 [E, N, K] along K -> (blocks uint8 [E, N, K/32, 16] (byte b:
    elements 2b low, 2b + 1 high), e8m0 scales uint8 [E, N, K/32]), as gpt-oss is released."""
    e, n, k = w.shape
    blocks = w.reshape(e, n, k // 32, 32)
    amax = np.abs(blocks).max(-1)
    exp = np.clip(np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -126, 127)
    codes = (
        np.clip(blocks / np.exp2(exp)[..., None], -E2M1_MAX, E2M1_MAX).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
        & 0xF
    )
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), (exp + 127).astype(np.uint8)


def write_mxfp4(directory: Path):
    """gpt-oss as released: experts' `gate_up_proj` / `down_proj` as MXFP4 `*_blocks` and
    `*_scales`, everything else unquantized. The reference model holds the experts as
    transformers' own MXFP4 loader dequantizes them (`convert_moe_packed_tensors`)."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = _read(directory)
    dequantized = dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4(tensors.pop(name).numpy().transpose(0, 2, 1))  # [E, in, out] -> [E, out, in]
        tensors[name + "_blocks"], tensors[name + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
        dequantized[name] = convert_moe_packed_tensors(
            tensors[name + "_blocks"], tensors[name + "_scales"], dtype=torch.float32
        )
    return _save(
        directory,
        tensors,
        dequantized,
        {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]},
    )
