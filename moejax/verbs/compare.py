"""`moejax compare`: every placement on the same model and prompts, side by side.

Checks that each placement's greedy tokens equal the single-device run's, and reports per
placement: prefill and decode step time (a second, warm run), bytes each device sends per
MoE layer and expert bytes each device reads per decode step (from the exchanges' own
sizes and the recorded router picks), and parameter bytes per device.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np

from moejax.base.errors import UsageError
from moejax.base.platform import run_dtype
from moejax.engine.expert_placement import wants_slots
from moejax.launch.factory import build_engine, ensure_devices, pd_devices, pd_engine
from moejax.launch.flags import (
    DEFAULT_PROMPTS,
    add_model_args,
    add_page_args,
    add_pd_args,
    config_from_args,
    pd_apart,
    prompt_ids,
)
from moejax.model.transformer import layer_params
from sharding import registry


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
    decode_picks = gen.picks[-(max_new_tokens - 1) :] if max_new_tokens > 1 else gen.picks
    moe_layers = [layer_params(engine.params, i, c, engine.loops)["moe"]["experts"] for i in c.moe_layers]
    sent, read, copies = [], [], []
    for step in decode_picks:
        step_read = 0
        for layer, ids in zip(moe_layers, step):
            sent.append(placement.bytes_sent_per_device(ids, c.hidden_size, act_bytes, layer).mean())
            copies.append(placement.copies_per_row(ids))
            step_read = step_read + placement.expert_bytes_read_per_device(ids, layer)
        read.append(np.max(step_read))
    return {
        "name": placement.name + ("+tbo" if placement.two_batch_overlap else ""),
        "ep": placement.ep,
        "tp": placement.tp,
        "attention": engine.config.layout.attention,
        "tokens": gen.tokens,
        "prefill_ms": round(gen.prefill_ms, 2),
        "decode_step_ms": round(gen.decode_step_ms, 2),
        "bytes_sent_per_device_per_moe_layer": round(float(np.mean(sent)), 1),
        "sent_counted_from": placement.sent_source,
        "copies_per_row": round(float(np.mean(copies)), 2),
        "expert_bytes_read_per_device_per_step": round(float(np.mean(read)), 1),
        "param_bytes_per_device": param_bytes_per_device(engine.params),
    }


def measure_pd(pd, prompts, max_new_tokens: int) -> dict:
    """One prefill x decode pair: its tokens, prefill, hand-over and decode step (a warm run)."""
    pd.generate(prompts, max_new_tokens)  # compile
    gen = pd.generate(prompts, max_new_tokens)
    side = lambda e: {
        "name": e.placement.name,
        "ep": e.placement.ep,
        "tp": e.placement.tp,
        "devices": [d.id for d in e.placement.mesh.devices.flat],
    }
    return {
        "prefill": side(pd.prefill),
        "decode": side(pd.decode),
        "tokens": gen.tokens,
        "prefill_ms": round(gen.prefill_ms, 2),
        "handover_ms": round(gen.handover_ms, 3),
        "handover_bytes": gen.handover_bytes,
        "handover_bytes_per_request": gen.handover_bytes // len(prompts),
        "decode_step_ms": round(gen.decode_step_ms, 2),
    }


def pd_rows(args, config, names: list[str], prompts, devices: int) -> list[dict]:
    """Every prefill placement x decode placement (or the ones --prefill/--decode-placement
    name), plain, on the split devices of the PD flags or all `devices` shared; engines built once per
    placement and mesh."""
    from moejax.engine.disaggregated import Disaggregated

    config = dataclasses.replace(config, layout=dataclasses.replace(config.layout, two_batch_overlap=False))
    prefill_devices, decode_devices = pd_devices(args, devices)
    shared = prefill_devices == decode_devices
    prefills = [args.prefill_placement] if args.prefill_placement else names
    decodes = [args.decode_placement] if args.decode_placement else names
    engines = {}

    def engine(devices, name):
        if (tuple(devices), name) not in engines:
            engines[tuple(devices), name] = pd_engine(config, devices, name, args, others=list(engines.values()))
        return engines[tuple(devices), name]

    return [
        measure_pd(Disaggregated(engine(prefill_devices, p), engine(decode_devices, d)), prompts, args.max_new_tokens)
        for p in prefills
        for d in decodes
        if not (shared and p == d)
    ]  # shared p == d: the single placement


def print_pd(rows: list[dict], expected, prompts) -> None:
    devices = lambda side: f"{side['devices'][0]}-{side['devices'][-1]}"
    print(
        f"\nprefill and decode on their own placements (hand-over: KV cache bytes that changed device, "
        f"{len(prompts)} requests)"
    )
    print(
        f"{'prefill':<16}{'devs':>5}{'decode':>17}{'devs':>5}{'same':>6}{'prefill ms':>12}{'hand-over ms':>14}"
        f"{'hand-over B':>13}{'B/request':>11}{'decode ms':>11}"
    )
    for r in rows:
        p, d = r["prefill"], r["decode"]
        print(
            f"{p['name']:<16}{devices(p):>5}{d['name']:>17}{devices(d):>5}"
            f"{'yes' if r['tokens'] == expected else 'NO':>6}"
            f"{r['prefill_ms']:>12.1f}{r['handover_ms']:>14.2f}{r['handover_bytes']:>13,}"
            f"{r['handover_bytes_per_request']:>11,}{r['decode_step_ms']:>11.2f}"
        )


def cmd_compare(args) -> int:
    devices = args.devices or 8
    ensure_devices(devices)
    config = config_from_args(args)
    # With the experts placed (--eplb, --redundant-experts), the placements it applies to.
    names = (
        args.placements.split(",")
        if args.placements
        else [
            n
            for n in registry.names()
            if not (wants_slots(config.layout) and registry.placement_class(n).holds_every_expert)
        ]
    )
    if pd_apart(args) and not args.pd:
        raise UsageError(
            "--prefill/--decode-placement and --prefill/--decode-devices choose the pairs of --pd; add --pd"
        )
    unknown = [n for n in names if n not in registry.names()]
    if unknown:
        raise UsageError(f"unknown placement {unknown[0]!r}; choose from {', '.join(registry.names())}")
    prompts = args.prompt_ids or DEFAULT_PROMPTS
    # Each placement plain, and with --two-batch-overlap also overlapped where its rows travel.
    variants = [(name, False) for name in names] + [
        (name, True)
        for name in names
        if config.layout.two_batch_overlap and not registry.placement_class(name).rows_stay_home
    ]
    config_of = lambda name, n, tbo: registry.with_placement(
        dataclasses.replace(config, layout=dataclasses.replace(config.layout, two_batch_overlap=tbo)), name, n
    )
    reference = build_engine(config_of(names[0], 1, False), args.hf, args.seed, args.checkpoint)
    reference.check_prompts(prompts)
    expected = reference.generate(prompts, args.max_new_tokens).tokens
    del reference
    rows = [
        measure(
            build_engine(config_of(name, devices, tbo), args.hf, args.seed, args.checkpoint),
            prompts,
            args.max_new_tokens,
        )
        for name, tbo in variants
    ]
    pairs = pd_rows(args, config, names, prompts, devices) if args.pd else []
    agree = all(r["tokens"] == expected for r in rows + pairs)
    if args.json:
        print(
            json.dumps(
                {"agree": agree, "devices": devices, "placements": rows, **({"pairs": pairs} if args.pd else {})}
            )
        )
        return 0
    print(
        f"{len(prompts)} requests, {args.max_new_tokens} new tokens, {devices} devices, "
        f"{config.model.family} ({run_dtype(config.engine.dtype)}, experts {config.weights.expert_format})"
    )
    head = (
        f"{'placement':<20}{'ep x tp':>8}{'attn':>5}{'same':>6}{'prefill ms':>12}{'decode ms':>11}"
        f"{'sent B/dev/layer':>18}{'copies':>8}{'read B/dev/step':>17}{'params B/dev':>14}"
    )
    print(head)
    sources = sorted({r["sent_counted_from"] for r in rows})
    marks = {s: "*" * i for i, s in enumerate(sources)}  # the first source unmarked
    for r in rows:
        mark = marks[r["sent_counted_from"]]
        sent = f"{r['bytes_sent_per_device_per_moe_layer']:,.0f}{mark}"
        copies = f"{r['copies_per_row']:.2f}{mark}"
        print(
            f"{r['name']:<20}{r['ep']:>4} x {r['tp']:<2}{r['attention']:>4}"
            f"{'yes' if r['tokens'] == expected else 'NO':>6}"
            f"{r['prefill_ms']:>12.1f}{r['decode_step_ms']:>11.2f}{sent:>18}{copies:>8}"
            f"{r['expert_bytes_read_per_device_per_step']:>17,.0f}{r['param_bytes_per_device']:>14,}"
        )
    for source in sources:
        print(f"{marks[source] or '(unmarked)'}: sent and copies counted from the {source}")
    if args.pd:
        print_pd(pairs, expected, prompts)
    print(
        "all placements agree with the single-device run" if agree else "PLACEMENTS DISAGREE with the single-device run"
    )
    return 0 if agree else 1


def register(sub) -> None:
    p = sub.add_parser("compare", help="run every placement on the same model and prompts (the main job)")
    add_model_args(p)
    add_page_args(p)
    p.add_argument("--placements", help=f"comma-separated subset of {','.join(registry.names())}")
    p.add_argument("--prompt-ids", type=prompt_ids, action="append", help="1,2,3 (repeat: one request each)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument(
        "--pd",
        action="store_true",
        help="also prefill under one placement and decode under another, every pair (the KV cache handed over)",
    )
    add_pd_args(p)
    p.set_defaults(func=cmd_compare)
