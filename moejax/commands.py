"""The serving verbs: generate, score, compare. Argument parsing and output only; the work
happens in the engine and the placements."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from moejax.config import Config, ConfigError, LayoutConfig, from_dict, load_file, replace_checked
from moejax.errors import UsageError
from moejax.vocab import ATTENTION_MODES, DISPATCH_DTYPES, EXPERT_FORMATS, KERNELS, RUN_DTYPES, SPLIT_MODES
from sharding import registry, rules
from sharding.mesh import make_mesh
from sharding.tensor_sliced import TensorSliced


def prompt_ids(text: str) -> list[int]:
    if not text.strip():
        raise argparse.ArgumentTypeError("--prompt-ids is empty; give token ids such as 1,2,3")
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids {text!r} is not a comma-separated list of integers") from None
    return ids


def placement_name(text: str) -> str:
    try:
        return registry.placement_class(text).name
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="a named model with random weights (default: tiny)")
    src.add_argument("--hf", metavar="DIR", help="a transformers save_pretrained directory")
    src.add_argument("--checkpoint", metavar="CKPT", help="a moejax checkpoint (moejax convert), restored into the placement")
    p.add_argument("--config", metavar="FILE", help="YAML or JSON config (DESIGN.md shape); flags override it")
    p.add_argument("--dtype", choices=RUN_DTYPES, help="auto: bfloat16 on accelerators, float32 on CPU")
    p.add_argument("--devices", type=int, help="number of devices (virtual CPU devices on a CPU host)")
    p.add_argument("--placement", type=placement_name, choices=registry.names(), help="expert placement")
    p.add_argument("--ep", type=int, help="expert groups, for a placement whose mesh the layout chooses")
    p.add_argument("--tp", type=int, help="slices of each expert, for a placement whose mesh the layout chooses")
    p.add_argument("--attention", choices=ATTENTION_MODES)
    p.add_argument("--head", choices=SPLIT_MODES, help="the vocab (embedding and LM head): sliced over every device, or copied")
    p.add_argument("--dispatch-dtype", choices=DISPATCH_DTYPES, help="rows as they travel to their experts")
    p.add_argument("--prefetch-depth", type=int, help="layers ahead that expert weights are gathered")
    p.add_argument("--two-batch-overlap", action="store_true", default=None,
                   help="placements that move rows: two micro-batches, one's exchange issued while the other computes")
    p.add_argument("--expert-format", choices=EXPERT_FORMATS, help="experts in --dtype (unquantized) or 4-bit")
    p.add_argument("--kernel", choices=KERNELS, help="grouped-GEMM backend (auto: by platform)")
    p.add_argument("--prefill-chunk", type=int, help="most prompt positions per prefill call (default: 1024 on CPU, 512 elsewhere)")
    p.add_argument("--routing", metavar="MODE", help="picks forced on the router: natural (default), even[:SEED], "
                   "round_robin, replay:TRACE (a `moejax record` trace)")
    p.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--num-processes", type=int, default=1, help="multi-host: processes in the run (jax.distributed)")
    p.add_argument("--process-id", type=int, default=0, help="multi-host: this process's index")
    p.add_argument("--coordinator", metavar="HOST:PORT", help="multi-host: process 0's address")


def config_from_args(args, host_default: bool = False) -> Config:
    """--config FILE (its `model:` fields on top of --preset, which wins over the file's own
    preset), then the flags. `host_default` (the verbs that run one model): a run whose flags and
    file choose no layout gets this host's (`layout.devices` 0, see `host_layout`)."""
    if args.devices is not None and args.devices < 1:
        raise UsageError(f"--devices must be at least 1, got {args.devices} (without it, a model runs on this host's layout)")
    config = (load_file(args.config, preset_name=args.preset) if args.config
              else from_dict({}, preset_name=args.preset))
    layout = {k: v for k, v in dict(
        placement=args.placement, devices=args.devices, ep=args.ep, tp=args.tp, attention=args.attention,
        head=args.head, dispatch_dtype=args.dispatch_dtype, prefetch_depth=args.prefetch_depth,
        two_batch_overlap=args.two_batch_overlap,
    ).items() if v is not None}
    apart = getattr(args, "prefill_placement", None) or getattr(args, "decode_placement", None)
    if host_default and not layout and config.layout == LayoutConfig() and args.num_processes == 1 and not apart:
        layout = {"devices": 0}
    engine = {k: v for k, v in dict(dtype=args.dtype, prefill_chunk=args.prefill_chunk,
                                    routing=getattr(args, "routing", None)).items() if v is not None}
    config = dataclasses.replace(
        config,
        layout=replace_checked(config.layout, layout, "layout."),
        engine=replace_checked(config.engine, engine, "engine."),
        weights=replace_checked(config.weights, {"expert_format": args.expert_format} if args.expert_format else {}, "weights."),
        kernel=args.kernel or config.kernel,
    )
    return config.validate()


def natural_routing_only(config: Config, what: str) -> None:
    """Paths whose jitted steps take no forced picks refuse a routing override rather than ignore it."""
    if config.engine.routing != "natural":
        raise UsageError(f"{what} does not take --routing (only natural routing there); drop --routing")


def init_processes(args) -> None:
    """Multi-host: join the jax.distributed run, this process holding devices / processes of the
    devices (virtual CPU devices here, talking through gloo). Must run before jax starts."""
    n = getattr(args, "num_processes", 1)
    if n <= 1:
        return
    if not args.coordinator or not 0 <= args.process_id < n:
        raise UsageError(f"--num-processes {n} needs --coordinator HOST:PORT and --process-id in 0..{n - 1}")
    devices = args.devices or 8
    if devices % n:
        raise UsageError(f"--devices {devices} cannot be split over {n} processes")
    p, d = getattr(args, "prefill_devices", 0), getattr(args, "decode_devices", 0)
    if (p or d) and (p != d or p % n):
        # The hand-over copies shard for shard, each process's prefill devices to its own decode devices.
        raise UsageError(f"over {n} processes, --prefill-devices and --decode-devices must be equal and divide by {n}; "
                         f"got {p} and {d}")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices // n}".strip()
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=n, process_id=args.process_id)


def cpu_devices(n: int) -> None:
    """Ask XLA:CPU for `n` virtual devices, unless XLA_FLAGS already names a count; takes effect
    only before jax first touches a backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def ensure_devices(n: int) -> None:
    """On a CPU host, make `n` virtual devices; must run before jax first touches a backend."""
    cpu_devices(n)
    import jax

    have = len(jax.devices())
    if have < n:
        raise UsageError(f"--devices {n} asked for, but this machine has {have} {jax.default_backend()} devices")


def host_layout(config: Config) -> Config:
    """`config` with layout.devices 0 ("auto") resolved for this host. On a CPU host of several
    cores: one virtual device per core, and every weight sliced over them (tensor-sliced experts,
    tensor-parallel attention, vocab-parallel head). XLA:CPU runs one device's program on one core
    (its expert loop, which bounds decode, never gets a second thread), so a single device leaves
    the other cores idle; sliced evenly, every device reads its share of each weight, the memory
    traffic a decode step is bound by. The benchmark model on this 2-core host, one device ->
    two: decode batch 16 134-138 -> 72-73 ms, prefill of 512 tokens 594-611 -> 519-534 ms, batch
    1 even (16-17 ms: the collectives eat the second core's share); same tokens. Elsewhere: one
    device (a mesh of accelerators is a choice: --devices, --placement)."""
    if config.layout.devices:
        return config
    cores = len(os.sched_getaffinity(0))
    cpu_devices(cores)
    import jax

    single = dataclasses.replace(config.layout, devices=1)
    if jax.default_backend() != "cpu":
        return dataclasses.replace(config, layout=single)
    # The most devices, up to one per core, that slice every expert evenly.
    for n in range(min(cores, len(jax.devices())), 1, -1):
        layout = dataclasses.replace(config.layout, placement=TensorSliced.name, devices=n, attention="tp", head="tp")
        try:
            rules.check_model(config.model, 1, n, config.weights.expert_format)
        except ConfigError:
            continue
        return dataclasses.replace(config, layout=layout)
    return dataclasses.replace(config, layout=single)


def build_engine(config: Config, hf_dir: str | None, seed: int, checkpoint: str | None = None,
                 devices: list | None = None, params: dict | None = None):
    """An engine of `config`'s placement on the machine's first devices, or on `devices`;
    `params`: already placed as this placement lays them out (else loaded and placed)."""
    # Deferred: orbax, safetensors and the model code load only for the verbs that run a model.
    from moejax.analysis.trace import load_trace
    from moejax.engine.engine import Engine
    from moejax.engine.routing import Routing
    from moejax.loading import load_params, with_hf_model

    config = host_layout(with_hf_model(config, hf_dir, checkpoint)).validate()
    routing = Routing.parse(config.engine.routing, load_trace)
    routing.check(config.model)  # before loading weights: a mismatched trace fails fast
    ensure_devices(config.layout.devices)
    placement = registry.make_placement(config, devices=devices)
    if params is None:
        params = load_params(config, placement, hf_dir=hf_dir, checkpoint=checkpoint, seed=seed)
    return Engine(config, params, placement, routing)


# ----------------------------------------------------------------------------- prefill / decode on their own placements

def add_pd_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-placement", type=placement_name, choices=registry.names(),
                   help="prefill under this placement (default --placement), decode under --decode-placement")
    p.add_argument("--decode-placement", type=placement_name, choices=registry.names(),
                   help="decode under this placement (default --placement); the KV cache is handed over")
    p.add_argument("--prefill-devices", type=int, default=0,
                   help="devices of the prefill mesh (the first ones; with --decode-devices; default: the --devices, shared)")
    p.add_argument("--decode-devices", type=int, default=0, help="devices of the decode mesh (the next ones)")


def pd_devices(args, shared: int) -> tuple[list, list]:
    """(prefill devices, decode devices) of the PD flags: split, or both the first `shared`."""
    from moejax.engine.disaggregated import split_devices

    p, d = args.prefill_devices, args.decode_devices
    if bool(p) != bool(d) or p < 0 or d < 0:
        raise UsageError(f"--prefill-devices and --decode-devices go together, both at least 1; got {p} and {d}")
    ensure_devices(p + d or shared)
    return split_devices(p, d, shared)


def pd_engine(config: Config, devices: list, name: str, args, others=()):
    """An engine of placement `name` on `devices`. Parameters are placed once per mesh: an
    engine of `others` on a mesh of the same devices and shape lays them out alike, and lends
    its own (two placements of one (ep, tp) shape differ only in their exchange)."""
    config = registry.with_placement(config, name, len(devices))
    mesh = make_mesh(registry.placement_class(name).mesh_shape(config.layout), devices)
    alike = [e for e in others if e.placement.mesh == mesh]
    return build_engine(config, args.hf, args.seed, args.checkpoint, devices=devices,
                        params=alike[0].params if alike else None)


def pd_engines(config: Config, args) -> tuple:
    """(prefill engine, decode engine) of the PD flags: --prefill/--decode-placement (default
    --placement) on their devices."""
    own = config.layout.placement or registry.DEFAULT
    prefill_devices, decode_devices = pd_devices(args, config.layout.devices)
    prefill = pd_engine(config, prefill_devices, args.prefill_placement or own, args)
    return prefill, pd_engine(config, decode_devices, args.decode_placement or own, args, others=[prefill])


def mtp_engine(engine, args, others=()):
    """`engine` with the model's MTP draft module (`--speculative mtp`), placed as its parameters;
    an engine of `others` with the same parameters lends its module."""
    from moejax.engine.speculative import SpeculativeEngine
    from moejax.loading import load_mtp

    alike = [o for o in others if o.engine.params is engine.params]
    mtp = alike[0].mtp if alike else load_mtp(engine.config, engine.placement, hf_dir=args.hf,
                                                checkpoint=getattr(args, "checkpoint", None), init=args.mtp_init,
                                                seed=args.seed)
    return SpeculativeEngine(engine, mtp)


def cmd_generate(args) -> int:
    from moejax.engine.sampling import Sampling

    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise UsageError(f"sampling needs --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1; got "
                         f"{args.temperature}, {args.top_k}, {args.top_p}")
    from moejax.engine import compile_clock
    from moejax.serving import text

    tokenizer = text.load_tokenizer(args)
    prompts, extra = text.encode_prompts(args.prompt_ids or [[1]], tokenizer, args.chat), {}
    stop_ids = text.model_stop_ids(args, tokenizer)
    config = config_from_args(args, host_default=True)
    if args.speculative:
        natural_routing_only(config, "--speculative mtp")
    compile_clock.start()
    t0 = compile_clock.now()
    if args.prefill_placement or args.decode_placement:
        from moejax.engine.disaggregated import Disaggregated

        prefill_engine, decode_engine = pd_engines(config, args)
        if args.speculative:
            prefill_engine = mtp_engine(prefill_engine, args)
            decode_engine = mtp_engine(decode_engine, args, others=[prefill_engine])
        engine = Disaggregated(prefill_engine, decode_engine)
    else:
        engine = build_engine(config, args.hf, args.seed, args.checkpoint)
        if args.speculative:
            engine = mtp_engine(engine, args)
    t1 = compile_clock.now()
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if (args.top_k or args.top_p < 1.0) and sampling.greedy:
        sampling = dataclasses.replace(sampling, temperature=1.0)
    gen = engine.generate(prompts, args.max_new_tokens, sampling, seed=args.sample_seed)
    if args.speculative:
        extra = {"acceptance_rate": gen.acceptance_rate}
    # A static batch runs every request to max_new_tokens; the stop rules then cut each one.
    done = [text.stopped(t, tokenizer, stop_ids, args.stop) for t in gen.tokens]
    if tokenizer is not None:
        extra["text"] = [d.text for d in done]
    if args.json:
        # Disjoint parts of the run: loading less its compiles, all compiles (or cache loads),
        # then the model's own prefill and mean decode step.
        timing = {"load_s": round(t1 - t0 - compile_clock.compile_seconds(t0, t1), 3),
                  "compile_s": round(compile_clock.compile_seconds(t0), 3),
                  "prefill_ms": round(gen.prefill_ms, 2),
                  "decode_step_ms": round(gen.step_ms if args.speculative else gen.decode_step_ms, 2)}
        if args.prefill_placement or args.decode_placement:
            timing.update(handover_ms=round(gen.handover_ms, 3), handover_bytes=gen.handover_bytes)
        print(json.dumps({"tokens": [d.tokens for d in done], "finish_reasons": [d.finish_reason for d in done], **extra,
                          "timing": timing}))
    else:
        for i, d in enumerate(done):
            print(f"request {i}: {' '.join(map(str, d.tokens))}" + (f"\n  {d.text!r}" if tokenizer else ""))
    return 0


def cmd_score(args) -> int:
    from moejax.engine.logprobs import prompt_logprobs
    from moejax.serving.text import encode_prompts
    from moejax.serving.tokenizer import Tokenizer

    prompts = encode_prompts(args.prompt_ids or [[1]], Tokenizer.for_run(args.tokenizer, args.hf), chat=False)
    engine = build_engine(config_from_args(args, host_default=True), args.hf, args.seed, args.checkpoint)
    logits = engine.score(prompts)
    scored = [prompt_logprobs(x, p, args.top_logprobs) for x, p in zip(logits, prompts)]
    if args.json:
        print(json.dumps({"logits": [x.tolist() for x in logits], "logprobs": scored}))
    else:
        for i, (x, lp) in enumerate(zip(logits, scored)):
            total = sum(v for v in lp["token_logprobs"] if v is not None)
            print(f"request {i}: {x.shape[0]} positions, argmax {x.argmax(-1).tolist()}, "
                  f"log-likelihood {total:.4f}, token logprobs {lp['token_logprobs']}")
    return 0


def register(sub) -> None:
    from moejax.serving.text import add_text_args as text_args

    g = sub.add_parser("generate", help="generate tokens for one batch of prompts")
    add_model_args(g)
    g.add_argument("--prompt-ids", type=prompt_ids, action="append", help="1,2,3 (repeat: one request each)")
    g.add_argument("--prompt", dest="prompt_ids", action="append", metavar="TEXT", help="prompt text (repeatable; in order with --prompt-ids)")
    g.add_argument("--chat", action="store_true", help="each --prompt is a user message under the model's chat template")
    text_args(g)
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=0,
                   help="seed of sampling: prompt i samples with seed S + i, what `serve` samples for a request "
                        "with that \"seed\"")
    g.add_argument("--speculative", choices=("mtp",), help="speculative decoding with the model's MTP draft module")
    g.add_argument("--mtp-init", choices=("random",), help="a random MTP module when the checkpoint carries none")
    add_pd_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("score", help="logits and per-token logprobs of one prefill")
    add_model_args(s)
    s.add_argument("--prompt-ids", type=prompt_ids, action="append", help="1,2,3 (repeat: one request each)")
    s.add_argument("--prompt", dest="prompt_ids", action="append", metavar="TEXT",
                   help="prompt text (repeatable; in order with --prompt-ids)")
    s.add_argument("--tokenizer", metavar="DIR", help="directory with tokenizer.json (default: the --hf directory)")
    s.add_argument("--top-logprobs", type=int, default=0, choices=range(0, 21), metavar="N",
                   help="the N best alternatives of every position (0..20), as the server's logprobs")
    s.set_defaults(func=cmd_score)
