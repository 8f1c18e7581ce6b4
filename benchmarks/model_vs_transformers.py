"""moejax against transformers on the same mid-size Qwen3-MoE, side by side in one run.

    python benchmarks/model_vs_transformers.py [--decode-steps 32] [--rounds 3]

Geometry (`GEOMETRY`): hidden 1024, 4 layers, 64 experts top-8, expert intermediate 256, vocab
32000, float32 on the CPU. Prints prefill tokens/s for a 512-token prompt and decode
tokens/s at batch 1 and 16, and the ratio moejax / transformers. Decode is also shown against
the weight-read bound: bytes a step must read (attention, router, touched experts, head) over
this machine's measured read bandwidth.

Prefill is a prompt's forward up to the logits of its last position on both sides (what
`generate` computes before the first new token; transformers' `logits_to_keep=1`).

Both sides run as a user gets them: moejax at its default settings (prefill chunk, buckets,
XLA flags), transformers in its fastest standard configuration: every expert implementation
it offers on the CPU runs in every round, and each measure keeps its fastest one over all
implementations and rounds. The settings of both sides are printed above the table.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
from grouped_gemm_cpu import read_bandwidth  # benchmarks/ is the script's own path

GEOMETRY = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
)
# --smoke: the same model family at toy width, to check the script runs.
SMOKE = dict(
    GEOMETRY,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
)


def hf_model(directory: str, geometry: dict = GEOMETRY):
    import torch
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        **geometry, norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    return model


BATCHES = (1, 16)
MEASURES = ("prefill", *(f"decode b{b}" for b in BATCHES))
HF_EXPERTS = ("eager", "grouped_mm", "batched_mm")  # transformers' CPU expert implementations


def hf_runner(model, prompt_len: int, steps: int, experts: str):
    """A function timing one round with transformers' expert implementation `experts`: [prefill
    seconds for one prompt of prompt_len, then seconds per decode step at each of BATCHES]. Its
    first call warms up."""
    import torch

    rng, vocab = np.random.default_rng(0), model.config.vocab_size
    long = torch.tensor(rng.integers(0, vocab, (1, prompt_len)))
    shorts = [torch.tensor(rng.integers(0, vocab, (batch, 32))) for batch in BATCHES]

    def decode(short) -> float:
        out = model(short, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for i in range(steps + 2):
            if i == 2:  # two warm-up steps
                t = time.perf_counter()
            out = model(tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - t) / steps

    def prefill() -> float:  # as `generate` prefills: the last position's logits only, as moejax's prefill
        t = time.perf_counter()
        model(long, logits_to_keep=1)
        return time.perf_counter() - t

    @torch.no_grad()
    def run() -> list[float]:
        model.set_experts_implementation(experts)
        return [prefill()] + [decode(short) for short in shorts]

    run()
    return run


def moejax_engine(directory: str):
    """The engine `moejax generate --hf DIR` builds with no other flag: default settings and this
    host's layout (on a CPU host, one device per core: `factory.host_layout`)."""
    from moejax.config import Config, LayoutConfig
    from moejax.launch.factory import build_engine

    return build_engine(Config(layout=LayoutConfig(devices=0)), directory, seed=0)


def moejax_runner(engine, prompt_len: int, steps: int):
    """As hf_runner, for a moejax engine; its first call compiles."""
    rng, vocab = np.random.default_rng(0), engine.c.vocab_size
    long = [rng.integers(0, vocab, prompt_len).tolist()]
    shorts = [[rng.integers(0, vocab, 32).tolist() for _ in range(batch)] for batch in BATCHES]

    def run() -> list[float]:
        prefill = engine.generate(long, 1).prefill_ms / 1e3
        return [prefill] + [engine.generate(short, steps + 1).decode_step_ms / 1e3 for short in shorts]

    run()
    return run


def step_bytes(batch: int, g: dict) -> float:
    """Weights a decode step must read: attention + router + dense head + touched experts."""
    d, layers, experts, k = g["hidden_size"], g["num_hidden_layers"], g["num_experts"], g["num_experts_per_tok"]
    f, vocab, heads, kv = (
        g["moe_intermediate_size"],
        g["vocab_size"],
        g["num_attention_heads"],
        g["num_key_value_heads"],
    )
    attn = d * (heads * g["head_dim"] + 2 * kv * g["head_dim"]) + heads * g["head_dim"] * d
    touched = experts * (1 - (1 - k / experts) ** batch)  # even router
    return 4 * (layers * (attn + d * experts + touched * 3 * d * f) + 2 * d * vocab)


def print_settings(experts: list[str], engine) -> None:
    import jax
    import torch
    import transformers

    from moejax.base.platform import prefill_chunk

    layout = engine.config.layout
    loop = "scanned" if engine.loops[-1].stacked else "unrolled"

    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end (other processes add noise)")
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}: {torch.get_num_threads()} threads, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, fastest expert implementation per measure "
        f"(of {', '.join(HF_EXPERTS)}): " + ", ".join(f"{m} {e}" for m, e in zip(MEASURES, experts))
    )
    print(
        f"moejax on jax {jax.__version__} ({jax.default_backend()}), defaults: {layout.placement} on "
        f"{layout.devices} device(s), attention {layout.attention}, head {layout.head}, layers {loop}, prefill chunk "
        f"{prefill_chunk(0)}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '') or 'none'}"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each is kept")
    ap.add_argument("--smoke", action="store_true", help="a toy-width model and a small bandwidth reading")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(os.cpu_count())
    with tempfile.TemporaryDirectory() as directory:
        geometry = SMOKE if args.smoke else GEOMETRY
        model = hf_model(directory, geometry)
        engine = moejax_engine(directory)  # first: it chooses the host's devices before jax starts
        bw = read_bandwidth(16 if args.smoke else 512)
        sides = {impl: hf_runner(model, args.prompt_len, args.decode_steps, impl) for impl in HF_EXPERTS}
        sides["moejax"] = moejax_runner(engine, args.prompt_len, args.decode_steps)
        # The host is shared and noisy: alternate the sides (each of transformers' expert
        # implementations is one) and keep each one's best round, so that a slow spell does not
        # land on one side only. The pause lets the other library's idle worker threads stop
        # spinning (OpenMP's and XLA's both spin a while).
        best = {name: [float("inf")] * len(MEASURES) for name in sides}
        for _ in range(args.rounds):
            for name, run in sides.items():
                time.sleep(1.0)
                best[name] = list(map(min, best[name], run()))
    experts = [min(HF_EXPERTS, key=lambda impl: best[impl][i]) for i in range(len(MEASURES))]
    (hf_pre, *hf_steps) = [best[impl][i] for i, impl in enumerate(experts)]
    (mj_pre, *mj_steps) = best["moejax"]
    print_settings(experts, engine)
    print(
        f"read bandwidth {bw / 1e9:.1f} GB/s; prompt {args.prompt_len} tokens; {args.decode_steps} decode steps; "
        f"best of {args.rounds} alternating rounds"
    )
    print(f"{'measure':<26}{'transformers':>14}{'moejax':>10}{'ratio':>8}{'bound':>9}")
    print(
        f"{'prefill tokens/s':<26}{args.prompt_len / hf_pre:>14.0f}{args.prompt_len / mj_pre:>10.0f}"
        f"{hf_pre / mj_pre:>8.2f}"
    )
    for batch, hf_step, mj_step in zip(BATCHES, hf_steps, mj_steps):
        bound = batch * bw / step_bytes(batch, geometry)
        print(
            f"{f'decode tokens/s, batch {batch}':<26}{batch / hf_step:>14.1f}{batch / mj_step:>10.1f}"
            f"{hf_step / mj_step:>8.2f}{bound:>9.0f}"
        )


if __name__ == "__main__":
    main()
