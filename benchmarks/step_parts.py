"""Where a decode step's time goes, per part, on both sides of `model_vs_transformers.py`.

    python benchmarks/step_parts.py [--steps 16] [--rounds 3]

The same model as model_vs_transformers (Qwen3-MoE, hidden 1024, 4 layers, 64 experts top-8,
vocab 32000, float32), decode at batch 1 and 16 after a 32-token prompt. Parts: attention, the
MoE block (router, expert weights read, expert products, combine), the LM head with the final
norm, embedding and sampling, and for moejax the collectives between its devices.

- transformers: forward hooks on each layer's attention and MoE block and on the LM head
  (CPU ops are synchronous, so a hook's wall time is the part's time); "rest" is the step
  less the hooked parts. Best of `rounds` rounds, fastest expert implementation at each batch.
- moejax (`moejax generate --hf`'s engine: this host's layout): one profiled decode
  (`jax.profiler`), each XLA op's time put in the part its HLO op_name names; ops without a
  name (XLA:CPU's dots) go with the named op before them on the same device thread. The table
  shows the mean over devices per step. Profiling slows the step (most where a loop runs many
  small ops); its profiled length is shown beside the unprofiled one, and the parts add up to
  the profiled one: "rest" holds the gaps between ops, the profiler's own time among them.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

import numpy as np
from model_vs_transformers import GEOMETRY, HF_EXPERTS, SMOKE, hf_model, moejax_engine

PARTS = (
    "attention",
    "MoE block",
    "LM head, embedding, sampling",
    "collectives (incl. waiting)",
    "rest (norms, residual; profiler)",
)


def hf_parts(model, batch: int, steps: int, rounds: int) -> tuple[float, dict, str]:
    """(step seconds, {part: seconds per step}, expert implementation) of transformers' fastest
    expert implementation at this batch."""
    import torch

    acc = collections.Counter()
    starts = {}

    def hook(name, module):
        module.register_forward_pre_hook(lambda m, a: starts.__setitem__(name, time.perf_counter()))
        module.register_forward_hook(
            lambda m, a, o: acc.__setitem__(name, acc[name] + time.perf_counter() - starts[name])
        )

    for layer in model.model.layers:
        hook(PARTS[0], layer.self_attn)
        hook(PARTS[1], layer.mlp)
    hook(PARTS[2], model.lm_head)
    prompt = torch.tensor(np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, 32)))
    best = (float("inf"), {}, "")
    with torch.no_grad():
        for _ in range(rounds):
            for impl in HF_EXPERTS:
                model.set_experts_implementation(impl)
                out = model(prompt, use_cache=True)
                cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
                for i in range(steps + 2):
                    if i == 2:  # two warm-up steps
                        acc.clear()
                        t = time.perf_counter()
                    out = model(tok, past_key_values=cache, use_cache=True)
                    cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
                step = (time.perf_counter() - t) / steps
                if step < best[0]:
                    parts = {k: v / steps for k, v in acc.items()}
                    best = (step, {**parts, PARTS[4]: step - sum(parts.values())}, impl)
    return best


def _part(op_name: str, event: str) -> str | None:
    """The part an XLA op belongs to, from its op_name (None: no name; layer norms and
    residual adds are "rest", as on transformers' side)."""
    if re.match(r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective|psum)", event):
        return PARTS[3]
    if not op_name:
        return None
    if "attention" in op_name:
        return PARTS[0]
    if re.search(r"(^|/)moe/|experts|grouped_gemm", op_name):
        return PARTS[1]
    return PARTS[4] if "layers" in op_name else PARTS[2]


def _fill(parts: list) -> list:
    """Unnamed ops (XLA:CPU's dots) take the part of the next named op that is not a collective
    (a projection precedes its attention's or experts' other ops), else of the one before."""
    out, following = list(parts), None
    for i in reversed(range(len(out))):
        if out[i] is None:
            out[i] = following
        elif out[i] != PARTS[3]:
            following = out[i]
    before = PARTS[4]
    for i, part in enumerate(out):
        out[i] = before = part or before
    return out


def moejax_parts(engine, batch: int, steps: int) -> tuple[float, float, dict]:
    """(step seconds unprofiled, profiled, {part: seconds per step, mean over devices})."""
    import jax
    import jax.numpy as jnp

    from moejax.engine.sampling import Sampling

    prompts = np.random.default_rng(0).integers(0, engine.c.vocab_size, (batch, 32)).tolist()  # transformers' prompts
    plain = min(engine.generate(prompts, steps + 1).decode_step_ms for _ in range(3)) / 1e3
    state = engine.start(prompts, steps + 1)
    hlo = (
        engine._decode_block.lower(
            engine.params,
            state.cache,
            state.tok,
            jnp.asarray(state.lens),
            state.seeds,
            1,
            steps,
            state.pages,
            block=engine.decode_block,
            sampling=Sampling(),
        )
        .compile()
        .as_text()
    )
    instructions = set(re.findall(r"%([\w.\-]+) = ", hlo))
    names = {m.group(1): m.group(2) for m in re.finditer(r'%([\w.\-]+) = [^\n]*?op_name="([^"]*)"', hlo)}
    with tempfile.TemporaryDirectory() as out:
        with jax.profiler.trace(out):
            profiled = engine.decode(state, steps + 1).decode_step_ms / 1e3
        trace = json.load(gzip.open(glob.glob(f"{out}/**/*.trace.json.gz", recursive=True)[0]))
    ops = sorted(
        (e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"] in instructions), key=lambda e: e["ts"]
    )
    by_thread = collections.defaultdict(list)
    for e in ops:
        if not e["name"].startswith(("while", "conditional", "call")):  # a loop's time is its body's ops
            by_thread[e["tid"]].append(e)
    parts = collections.Counter()
    for events in by_thread.values():
        for e, part in zip(events, _fill([_part(names.get(e["name"], ""), e["name"]) for e in events])):
            parts[part] += e["dur"] / 1e6 / steps
    devices = engine.config.layout.devices
    parts = {k: v / devices for k, v in parts.items()}
    return plain, profiled, {**parts, PARTS[4]: parts.get(PARTS[4], 0.0) + profiled - sum(parts.values())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a toy-width model")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(os.cpu_count())
    with tempfile.TemporaryDirectory() as directory:
        model = hf_model(directory, SMOKE if args.smoke else GEOMETRY)
        engine = moejax_engine(directory)
        layout = engine.config.layout
        print(
            f"transformers: torch {torch.__version__}, {torch.get_num_threads()} threads; moejax: {layout.placement} "
            f"on {layout.devices} device(s), attention {layout.attention}, head {layout.head}"
        )
        for batch in (1, 16):
            hf_step, hf, impl = hf_parts(model, batch, args.steps, args.rounds)
            plain, profiled, mj = moejax_parts(engine, batch, args.steps)
            print(
                f"\ndecode batch {batch}: transformers {hf_step * 1e3:.1f} ms/step ({impl}); moejax {plain * 1e3:.1f} "
                f"ms/step, {profiled * 1e3:.1f} profiled (per device)"
            )
            print(f"{'part':<32}{'transformers ms':>16}{'moejax ms':>12}")
            for part in PARTS:
                print(f"{part:<32}{hf.get(part, 0.0) * 1e3:>16.1f}{mj.get(part, 0.0) * 1e3:>12.1f}")


if __name__ == "__main__":
    main()
