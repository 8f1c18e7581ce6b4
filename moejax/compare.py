"""`moejax compare`: every placement on the same model and prompts, side by side.

Checks that each placement's greedy tokens equal the single-device run's, and reports per
placement: prefill and decode step time (a second, warm run), bytes each device sends per
MoE layer and expert bytes each device reads per decode step (from the exchanges' own
sizes and the recorded router picks), and parameter bytes per device.
"""

from __future__ import annotations

import json

import jax
import numpy as np

from moejax.commands import add_model_args, build_engine, config_from_args, ensure_devices, prompt_ids
from moejax.errors import UsageError
from moejax.model.transformer import layer_params
from sharding import registry

# Eight requests of different lengths: one per device under DP attention.
DEFAULT_PROMPTS = [[(7 * r + 3 * i) % 97 + 1 for i in range(5 + 3 * r)] for r in range(8)]


def param_bytes_per_device(params) -> int:
    per = {}
    for leaf in jax.tree.leaves(params):
        for shard in leaf.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values())


def measure(engine, prompts, max_new_tokens: int) -> dict:
    engine.generate(prompts, max_new_tokens, record=True)  # compile
    gen = engine.generate(prompts, max_new_tokens, record=True)
    placement, c = engine.placement, engine.c
    act_bytes = engine.dtype.itemsize
    decode_picks = gen.picks[-(max_new_tokens - 1):] if max_new_tokens > 1 else gen.picks
    moe_layers = [layer_params(engine.params, i, c)["moe"]["experts"] for i in c.moe_layers]
    sent, read, copies = [], [], []
    for step in decode_picks:
        step_read = 0
        for layer, ids in zip(moe_layers, step):
            sent.append(placement.bytes_sent_per_device(ids, c.hidden_size, act_bytes, layer).mean())
            copies.append(placement.copies_per_row(ids))
            step_read = step_read + placement.expert_bytes_read_per_device(ids, layer)
        read.append(np.max(step_read))
    return {
        "name": placement.name, "ep": placement.ep, "tp": placement.tp,
        "attention": engine.config.layout.attention, "tokens": gen.tokens,
        "prefill_ms": round(gen.prefill_ms, 2), "decode_step_ms": round(gen.decode_step_ms, 2),
        "bytes_sent_per_device_per_moe_layer": round(float(np.mean(sent)), 1),
        "sent_counted_from": placement.sent_source,
        "copies_per_row": round(float(np.mean(copies)), 2),
        "expert_bytes_read_per_device_per_step": round(float(np.mean(read)), 1),
        "param_bytes_per_device": param_bytes_per_device(engine.params),
    }


def cmd_compare(args) -> int:
    devices = args.devices or 8
    ensure_devices(devices)
    config = config_from_args(args)
    names = args.placements.split(",") if args.placements else list(registry.names())
    unknown = [n for n in names if n not in registry.names()]
    if unknown:
        raise UsageError(f"unknown placement {unknown[0]!r}; choose from {', '.join(registry.names())}")
    prompts = args.prompt_ids or DEFAULT_PROMPTS
    reference = build_engine(registry.with_placement(config, names[0], 1), args.hf, args.seed, args.checkpoint)
    reference.check_prompts(prompts)
    expected = reference.generate(prompts, args.max_new_tokens).tokens
    del reference
    rows = [measure(build_engine(registry.with_placement(config, name, devices), args.hf, args.seed, args.checkpoint),
                    prompts, args.max_new_tokens)
            for name in names]
    agree = all(r["tokens"] == expected for r in rows)
    if args.json:
        print(json.dumps({"agree": agree, "devices": devices, "placements": rows}))
        return 0
    print(f"{len(prompts)} requests, {args.max_new_tokens} new tokens, {devices} devices, "
          f"{config.model.family} ({config.engine.run_dtype}, experts {config.weights.expert_format})")
    head = f"{'placement':<16}{'ep x tp':>8}{'attn':>5}{'same':>6}{'prefill ms':>12}{'decode ms':>11}" \
           f"{'sent B/dev/layer':>18}{'copies':>8}{'read B/dev/step':>17}{'params B/dev':>14}"
    print(head)
    sources = sorted({r["sent_counted_from"] for r in rows})
    marks = {s: "*" * i for i, s in enumerate(sources)}  # the first source unmarked
    for r in rows:
        mark = marks[r["sent_counted_from"]]
        sent = f"{r['bytes_sent_per_device_per_moe_layer']:,.0f}{mark}"
        copies = f"{r['copies_per_row']:.2f}{mark}"
        print(f"{r['name']:<16}{r['ep']:>4} x {r['tp']:<2}{r['attention']:>4}{'yes' if r['tokens'] == expected else 'NO':>6}"
              f"{r['prefill_ms']:>12.1f}{r['decode_step_ms']:>11.2f}{sent:>18}{copies:>8}"
              f"{r['expert_bytes_read_per_device_per_step']:>17,.0f}{r['param_bytes_per_device']:>14,}")
    for source in sources:
        print(f"{marks[source] or '(unmarked)'}: sent and copies counted from the {source}")
    print("all placements agree with the single-device run" if agree else "PLACEMENTS DISAGREE with the single-device run")
    return 0 if agree else 1


def register(sub) -> None:
    p = sub.add_parser("compare", help="run every placement on the same model and prompts (the main job)")
    add_model_args(p)
    p.add_argument("--placements", help=f"comma-separated subset of {','.join(registry.names())}")
    p.add_argument("--prompt-ids", type=prompt_ids, action="append", help="1,2,3 (repeat: one request each)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.set_defaults(func=cmd_compare)
