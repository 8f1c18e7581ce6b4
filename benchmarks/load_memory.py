"""Peak host memory of loading a model onto 8 devices, and of `moejax convert`, against the
model's size.

    PYTHONPATH=. python benchmarks/load_memory.py [--layers 8] [--dir /tmp/moejax-load-memory]

Writes a Qwen3-MoE-shaped transformers directory (random float32, one shard per layer, 32
experts per layer stored one tensor each, as transformers does). Then, each in its own process:
loads it onto 8 virtual CPU devices under two placements, with bf16 and NVFP4 experts (the
loaded parameters live in the process here, so the figure that matters is the peak above
baseline + the bytes placed), and converts it with `python -m moejax convert`. The baseline is
the same work on the 3-layer golden model (the fixed cost of Python, jax and orbax). About 2 GB
of disk for the default 8 layers.
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
    return {
        "model_type": "qwen3_moe",
        "vocab_size": V,
        "hidden_size": D,
        "num_hidden_layers": layers,
        "num_attention_heads": H,
        "num_key_value_heads": KV,
        "head_dim": DH,
        "intermediate_size": 2048,
        "moe_intermediate_size": F,
        "num_experts": E,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }


def layer_tensors(i: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    def w(*shape):
        return 0.02 * rng.standard_normal(shape, dtype=np.float32)

    p = f"model.layers.{i}."
    t = {
        p + "input_layernorm.weight": np.ones(D, np.float32),
        p + "post_attention_layernorm.weight": np.ones(D, np.float32),
        p + "self_attn.q_proj.weight": w(H * DH, D),
        p + "self_attn.k_proj.weight": w(KV * DH, D),
        p + "self_attn.v_proj.weight": w(KV * DH, D),
        p + "self_attn.o_proj.weight": w(D, H * DH),
        p + "self_attn.q_norm.weight": np.ones(DH, np.float32),
        p + "self_attn.k_norm.weight": np.ones(DH, np.float32),
        p + "mlp.gate.weight": w(E, D),
    }
    for e in range(E):
        t |= {
            p + f"mlp.experts.{e}.gate_proj.weight": w(F, D),
            p + f"mlp.experts.{e}.up_proj.weight": w(F, D),
            p + f"mlp.experts.{e}.down_proj.weight": w(D, F),
        }
    return t


def write_model(directory: Path, layers: int) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf_config(layers)))
    weight_map = {}
    shards = [
        {
            "model.embed_tokens.weight": 0.02 * rng.standard_normal((V, D), dtype=np.float32),
            "model.norm.weight": np.ones(D, np.float32),
            "lm_head.weight": 0.02 * rng.standard_normal((V, D), dtype=np.float32),
        }
    ]
    for i in range(layers + 1):  # shard i holds layer i (the last: embeddings and head); one in memory at a time
        tensors = layer_tensors(i, rng) if i < layers else shards[0]
        name = f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors"
        save_file(tensors, str(directory / name))
        weight_map |= dict.fromkeys(tensors, name)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


# Loads a directory onto 8 devices and prints the bytes placed (every device's shards).
LOAD = """
import json, sys
import jax
from moejax.config import Config, EngineConfig, LayoutConfig, WeightsConfig
from moejax.launch.loading import load_params, with_hf_model
from sharding import make_placement
hf, placement, fmt = sys.argv[1:]
config = with_hf_model(Config(layout=LayoutConfig(devices=8, placement=placement), weights=WeightsConfig(fmt),
                              engine=EngineConfig(dtype="bfloat16")), hf).validate()
params = load_params(config, make_placement(config), hf_dir=hf)
print(sum(s.data.nbytes for a in jax.tree.leaves(params) for s in a.addressable_shards))
"""
LOADS = [("expert_sharded", "unquantized"), ("tensor_sliced", "unquantized"), ("expert_sharded", "nvfp4")]


def peak_rss_mb(argv: list[str]) -> tuple[float, str]:
    """Peak RSS of one child process (its own rusage, not the max over all children), and its stdout."""
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8"
    )
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(argv)} failed")
    return usage.ru_maxrss / 1024, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/moejax-load-memory"))
    parser.add_argument("--smoke", action="store_true", help="the first load only (with --layers 1: a quick check)")
    args = parser.parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    hf = args.dir / "hf"
    write_model(hf, args.layers)
    model_mb = sum(p.stat().st_size for p in hf.glob("*.safetensors")) / 2**20
    layer_mb = 3 * E * D * F * 4 / 2**20  # one layer's expert stacks, as read
    golden = str(ROOT / "tests/golden/qwen3_moe")
    print(
        f"model {model_mb:,.0f} MB (float32) in {args.layers} layers; one layer's experts {layer_mb:,.0f} MB; "
        f"one run's stacked expert matrix {args.layers * E * D * F * 4 / 2**20:,.0f} MB\n"
    )
    print("| job | peak RSS MB | baseline MB | placed MB | above baseline + placed, MB |")
    print("|---|---|---|---|---|")
    for placement, fmt in LOADS[:1] if args.smoke else LOADS:
        load = [sys.executable, "-c", LOAD]
        baseline, _ = peak_rss_mb([*load, golden, placement, "unquantized"])
        peak, placed = peak_rss_mb([*load, str(hf), placement, fmt])
        placed_mb = int(placed) / 2**20
        print(
            f"| load {placement} {fmt} | {peak:,.0f} | {baseline:,.0f} | {placed_mb:,.0f} | "
            f"{peak - baseline - placed_mb:,.0f} |"
        )
    convert = [sys.executable, "-m", "moejax", "convert", "--json", "--out"]
    baseline, _ = peak_rss_mb([*convert, str(args.dir / "golden"), "--hf", golden])
    peak, _ = peak_rss_mb([*convert, str(args.dir / "ckpt"), "--hf", str(hf)])
    print(f"| convert (float32) | {peak:,.0f} | {baseline:,.0f} | 0 | {peak - baseline:,.0f} |")


if __name__ == "__main__":
    main()
