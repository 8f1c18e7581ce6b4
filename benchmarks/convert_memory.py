"""Peak memory of `moejax convert` on a model many times larger than its largest tensor.

    PYTHONPATH=. python benchmarks/convert_memory.py [--layers 8] [--dir /tmp/moejax-convert-memory]

Writes a Qwen3-MoE-shaped transformers directory (random float32, one shard per layer, 32
experts per layer stored one tensor each, as transformers does), converts it with
`python -m moejax convert`, and prints the converter's peak RSS beside the model's size, its
largest tensor and the peak RSS of converting the 3-layer golden model (the fixed cost of
Python, jax and orbax). About 2 GB of disk for the default 8 layers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).parent.parent
D, F, E, V, H, KV, DH = 1024, 512, 32, 16000, 16, 4, 64


def hf_config(layers: int) -> dict:
    return {"model_type": "qwen3_moe", "vocab_size": V, "hidden_size": D, "num_hidden_layers": layers,
            "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": DH, "intermediate_size": 2048,
            "moe_intermediate_size": F, "num_experts": E, "num_experts_per_tok": 4, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu"}


def layer_tensors(i: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    def w(*shape):
        return (0.02 * rng.standard_normal(shape, dtype=np.float32))

    p = f"model.layers.{i}."
    t = {p + "input_layernorm.weight": np.ones(D, np.float32), p + "post_attention_layernorm.weight": np.ones(D, np.float32),
         p + "self_attn.q_proj.weight": w(H * DH, D), p + "self_attn.k_proj.weight": w(KV * DH, D),
         p + "self_attn.v_proj.weight": w(KV * DH, D), p + "self_attn.o_proj.weight": w(D, H * DH),
         p + "self_attn.q_norm.weight": np.ones(DH, np.float32), p + "self_attn.k_norm.weight": np.ones(DH, np.float32),
         p + "mlp.gate.weight": w(E, D)}
    for e in range(E):
        t |= {p + f"mlp.experts.{e}.gate_proj.weight": w(F, D), p + f"mlp.experts.{e}.up_proj.weight": w(F, D),
              p + f"mlp.experts.{e}.down_proj.weight": w(D, F)}
    return t


def write_model(directory: Path, layers: int) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf_config(layers)))
    weight_map = {}
    shards = [{"model.embed_tokens.weight": 0.02 * rng.standard_normal((V, D), dtype=np.float32),
               "model.norm.weight": np.ones(D, np.float32),
               "lm_head.weight": 0.02 * rng.standard_normal((V, D), dtype=np.float32)}]
    for i in range(layers + 1):  # shard i holds layer i (the last: embeddings and head); one in memory at a time
        tensors = layer_tensors(i, rng) if i < layers else shards[0]
        name = f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors"
        save_file(tensors, str(directory / name))
        weight_map |= dict.fromkeys(tensors, name)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def peak_rss_mb(argv: list[str]) -> float:
    """Peak RSS of one child process (its own rusage, not the max over all children)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(argv)} failed")
    return usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/moejax-convert-memory"))
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    hf = args.dir / "hf"
    write_model(hf, args.layers)
    model_mb = sum(p.stat().st_size for p in hf.glob("*.safetensors")) / 2**20
    largest_mb = max(V * D, E * D * F) * 4 / 2**20  # embeddings / lm_head vs one stacked expert matrix
    convert = [sys.executable, "-m", "moejax", "convert", "--json", "--out"]
    baseline = peak_rss_mb([*convert, str(args.dir / "golden"), "--hf", str(ROOT / "tests/golden/deepseek_v3")])
    peak = peak_rss_mb([*convert, str(args.dir / "ckpt"), "--hf", str(hf)])
    print(f"model {model_mb:,.0f} MB in {args.layers} layers, largest tensor {largest_mb:,.0f} MB")
    print(f"convert peak RSS {peak:,.0f} MB; baseline (3-layer golden model) {baseline:,.0f} MB; "
          f"above baseline {peak - baseline:,.0f} MB = {(peak - baseline) / largest_mb:.1f} x the largest tensor, "
          f"{(peak - baseline) / model_mb:.2f} x the model")


if __name__ == "__main__":
    main()
