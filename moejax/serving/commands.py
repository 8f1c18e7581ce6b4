"""The `serve` and `bench` verbs."""

from __future__ import annotations

import argparse
import functools
import os
import sys

from moejax.base.errors import UsageError


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", metavar="DIR", help="directory with tokenizer.json (default: the --hf directory)")
    p.add_argument("--slots", type=int, default=16, help="decode slots: requests decoding at once, at most")
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=0,
        help="the longest request, prompt and new tokens (default: model "
        "context, at most 2048; bench without --url: its requests' length)",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=0,
        help="positions the KV cache's page pool holds, shared by "
        "all requests (default: 32768 on CPU, else 80%% of the device memory free after the weights)",
    )
    p.add_argument(
        "--kv-cache-gb", type=float, default=0.0, help="the page pool's size in GB instead of --kv-cache-tokens"
    )
    p.add_argument("--page-size", type=int, default=16, help="positions per KV cache page")
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="compute every prompt whole (default: reuse the pages of the longest prefix computed before)",
    )
    p.add_argument("--prefill-rows", type=int, default=1, help="requests per prefill call")
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=0,
        help="tokens per step, decode + prefill (default: slots + one prefill call)",
    )
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond which new ones get 429")
    p.add_argument("--speculative", choices=("mtp",), help="decode with the model's MTP draft module (greedy requests)")
    p.add_argument("--mtp-init", choices=("random",), help="a random MTP module when the checkpoint carries none")
    p.add_argument(
        "--eplb-online",
        action="store_true",
        default=None,
        help="rebalance the experts' placement from live traffic, moving them between decode steps",
    )
    p.add_argument("--eplb-window", type=int, help="forward passes of live picks a rebalance looks at (default 64)")
    p.add_argument("--eplb-interval", type=int, help="steps between rebalances (default 32)")


def build_scheduler(args, progress: bool = True, longest: int = 0):
    """(scheduler, tokenizer, end-of-sequence ids), compiled and ready. `longest`: prompt + new
    tokens of the longest request it will serve, when known (0: any the model takes)."""
    from tqdm import tqdm

    from moejax.launch.factory import build_engine, pd_engines
    from moejax.launch.flags import config_from_args, natural_routing_only, pd_apart
    from moejax.serving.scheduler import Scheduler
    from moejax.serving.tokenizer import Tokenizer, eos_ids

    tokenizer = Tokenizer.for_run(args.tokenizer, args.hf)
    eos = tokenizer.eos_ids if tokenizer else (eos_ids(args.hf) or ()) if args.hf else ()
    with tqdm(total=2, desc="load + compile", disable=None if progress else True, file=sys.stderr) as bar:
        config = config_from_args(args, host_default=True)
        apart = pd_apart(args)
        if args.speculative == "mtp":
            natural_routing_only(config, "--speculative mtp")
            if apart:
                raise UsageError(
                    "serving with --speculative mtp decodes under one placement; drop "
                    "--prefill-placement/--decode-placement/--prefill-devices/--decode-devices"
                )
        kw = dict(
            slots=args.slots,
            max_len=args.max_seq_len,
            prefill_rows=args.prefill_rows,
            token_budget=args.max_batched_tokens,
            max_queue=args.max_queue,
            longest=longest,
            kv_tokens=args.kv_cache_tokens,
            kv_gb=args.kv_cache_gb,
            page_size=args.page_size,
            prefix_cache=not args.no_prefix_cache,
        )
        if apart:
            kw["prefill_engine"], engine = pd_engines(config, args)
        else:
            engine = build_engine(config, args.hf, args.seed, args.checkpoint)
        bar.update()
        if args.speculative == "mtp":
            from moejax.launch.loading import load_mtp
            from moejax.serving.speculative import SpecScheduler

            mtp = load_mtp(
                engine.config,
                engine.placement,
                hf_dir=args.hf,
                checkpoint=args.checkpoint,
                init=args.mtp_init,
                seed=args.seed,
            )
            scheduler = SpecScheduler(engine, mtp, **kw)
        else:
            scheduler = Scheduler(engine, **kw)
        for note in scheduler.notes:
            print(f"moejax: {note}", file=sys.stderr)
        layout = engine.config.layout
        if layout.eplb_online:
            if apart or args.speculative:
                raise UsageError(
                    "--eplb-online rebalances one engine's experts; drop --speculative, "
                    "--prefill-placement and --decode-placement"
                )
            from moejax.serving.online_eplb import OnlineEPLB

            OnlineEPLB(scheduler, layout.eplb_window, layout.eplb_interval).warm_up()
        scheduler.warm_up()
        bar.update()
    return scheduler, tokenizer, eos


def model_name(args) -> str:
    return args.served_model_name or args.hf or args.checkpoint or args.preset or "tiny"


LOST_GRACE_S = 5.0  # a lost process: time for the failed requests' 503s to go out before exiting


def cmd_serve(args) -> int:
    """Over several processes (--num-processes): process 0 serves HTTP and decides every step;
    the others follow its step plans (`serving/follower.py`)."""
    from moejax.analysis.serve_ranking import rank
    from moejax.serving.layout_choice import choose
    from moejax.serving.metrics import Metrics, TraceRecorder
    from moejax.serving.server import build_app, serve

    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port} is not a TCP port")
    if args.record and args.speculative:
        raise UsageError(
            "--record records the router's picks, which the MTP programs do not read back; "
            "drop --speculative or --record"
        )
    api_key = args.api_key or os.environ.get("MOEJAX_API_KEY") or None
    choice = choose(args, rank)  # --placement auto: the layout advise ranks first
    if choice is not None:
        args = choice.layout.applied(args)
    leader = None
    if args.num_processes > 1 and args.process_id == 0:
        from moejax.serving.plan_link import Leader

        leader = Leader(args.coordinator, args.num_processes - 1)  # listening before the followers' warm-up ends
    scheduler, tokenizer, eos = build_scheduler(args)
    if args.num_processes > 1 and args.process_id != 0:
        from moejax.serving.follower import follow

        return follow(scheduler, args.process_id)
    name = model_name(args)
    metrics = Metrics(scheduler, window=args.expert_window)
    recorder = TraceRecorder(scheduler, name) if args.record else None
    if choice is not None:
        choice.follow(scheduler)
        metrics.registry.register(choice)
    if leader is not None:
        leader.accept()
        leader.on_lost = functools.partial(_lost, scheduler)
        scheduler.link = leader
        metrics.registry.register(leader)
    app = build_app(
        scheduler,
        metrics,
        tokenizer=tokenizer,
        eos_ids=eos,
        model_name=name,
        api_key=api_key,
        on_exit=(lambda: recorder.save(args.record)) if recorder else None,
        failure=(lambda: leader.lost) if leader else None,
    )
    serve(app, args.host, args.port)
    if leader is not None:
        leader.stop()
    return 0


def _lost(scheduler, message: str) -> None:
    """Process 0, a follower lost: every request fails with 503, then the process exits 1."""
    import threading

    print(f"moejax serve: {message}; failing every request and exiting", file=sys.stderr, flush=True)
    scheduler.fail(f"the server lost a process ({message})")
    threading.Timer(LOST_GRACE_S, os._exit, (1,)).start()


def cmd_bench(args) -> int:
    import json

    from moejax.serving import bench

    if not 0 <= args.shared_prefix_len <= args.input_len:
        raise UsageError(f"--shared-prefix-len {args.shared_prefix_len} must lie in 0..--input-len {args.input_len}")
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise UsageError("--num-prompts, --input-len and --output-len must be at least 1")
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise UsageError("--request-rate must be positive and --max-concurrency at least 1")
    if args.url:
        client = bench.HTTPClient(args.url, args.api_key or os.environ.get("MOEJAX_API_KEY"))
    else:
        from moejax.serving.metrics import DeviceRows

        # Its own server holds only the requests it sends: a cache of their length (--max-seq-len).
        scheduler = build_scheduler(args, longest=args.input_len + args.output_len)[0]
        rows = DeviceRows(scheduler.engine)
        scheduler.pick_observers.append(rows.observe)
        client = bench.LocalClient(scheduler)
    summary = bench.run(
        client,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        shared_prefix_len=args.shared_prefix_len,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        seed=args.bench_seed,
    )
    if not args.url:
        client.close()
        summary["device_rows"] = rows.total.tolist()  # rows each device's experts computed, all MoE layers
        if scheduler.rebalancer is not None:
            summary["eplb"] = scheduler.rebalancer.summary()
    print(json.dumps(summary) if args.json else bench.table(summary))
    return 0 if summary["failed"] == 0 else 1


def register(sub) -> None:
    from moejax.launch.flags import add_model_args, add_pd_args

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching and Prometheus metrics")
    add_model_args(s, auto=True)
    add_scheduler_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: $MOEJAX_API_KEY)"
    )
    s.add_argument("--served-model-name", help="the model name clients send (default: the model source)")
    s.add_argument("--record", metavar="FILE", help="write the router picks of all traffic as a trace at exit")
    s.add_argument("--expert-window", type=int, default=100, help="forward passes in /metrics' expert load")
    add_pd_args(s, auto=True)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="load generator: throughput and TTFT/TPOT/ITL/latency percentiles")
    b.add_argument(
        "--url",
        help="a running server (moejax serve or any OpenAI-compatible one); without it, "
        "the model flags build an in-process engine",
    )
    b.add_argument("--api-key", help="bearer key for --url (default: $MOEJAX_API_KEY)")
    b.add_argument("--num-prompts", type=int, default=64)
    b.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    b.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="the first N prompt tokens are the same in every request (a shared system prompt)",
    )
    b.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    b.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s, Poisson arrivals (default: all at once)"
    )
    b.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    b.add_argument("--bench-seed", type=int, default=0, help="seed of the prompts and arrival times")
    add_model_args(b)
    add_scheduler_args(b)
    add_pd_args(b)
    b.set_defaults(func=cmd_bench)
