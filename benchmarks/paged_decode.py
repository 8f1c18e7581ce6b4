"""The paged KV cache in the serving scheduler, on the tiny model, single device:

- decode time follows the tokens held: mean TPOT of 16 requests of 32 + 32 tokens (--slots 16)
  with --max-seq-len 2048 against 128 (a contiguous cache, which read every slot's whole row:
  4.3x);
- a step's cost does not follow the pool's size: mean TPOT of the same requests with a pool of
  2,048 positions against 32,768 (--kv-cache-tokens);
- the prefix cache: 16 requests of 400 tokens sharing their first 384, sent one at a time: mean
  TTFT with the prefix cache against without, and the positions prefill computed;
- capacity: in the KV memory of --slots 8 --max-seq-len 2048 (16,384 positions), how many
  requests of 128 + 128 tokens decode together (a contiguous cache: 8).

A/B rounds alternate (the host is shared: interleaving spreads its load over both sides).

    python benchmarks/paged_decode.py [--rounds 3] [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np

from moejax.config import Config, preset
from moejax.engine.engine import Engine
from moejax.launch.loading import load_params
from moejax.serving.scheduler import Request, Scheduler
from moejax.serving.stopping import Stopper
from sharding import make_placement

# (requests, prompt, new tokens, short / long --max-seq-len, shared prefix, prefix prompt,
#  capacity's slots x max-seq-len and request length)
FULL = dict(
    requests=16,
    prompt=32,
    new=32,
    max_lens=(128, 2048),
    pools=(2048, 32768),
    shared=384,
    prefix_prompt=400,
    kv=(8, 2048),
    request_len=256,
)
SMOKE = dict(
    requests=4,
    prompt=8,
    new=4,
    max_lens=(32, 128),
    pools=(256, 4096),
    shared=32,
    prefix_prompt=40,
    kv=(2, 128),
    request_len=32,
)


class Counting(Scheduler):
    """A scheduler that notes the most requests one decode step ran."""

    most_decoding = 0

    def _decode_step(self, decoding):
        self.most_decoding = max(self.most_decoding, len(decoding))
        super()._decode_step(decoding)


def prompts(n: int, length: int, shared: int = 0, seed: int = 0) -> list[list[int]]:
    """`bench`'s prompts: random ids, the first `shared` the same in every one."""
    p = np.random.default_rng(seed).integers(10, preset("tiny").vocab_size, (n, length))
    p[:, :shared] = p[0, :shared]
    return p.tolist()


def send(scheduler: Scheduler, batch: list[list[int]], new: int) -> list[Request]:
    """The prompts at once, through the scheduler on this thread (as `bench` with no rate limit)."""
    return scheduler.run_all([Request(p, new, Stopper(None)) for p in batch])


def tpot_ms(requests: list[Request]) -> float:
    return 1e3 * float(np.mean([(r.token_times[-1] - r.token_times[0]) / (len(r.tokens) - 1) for r in requests]))


class Sides:
    """Each side's scheduler, built once; its first load is run untimed (it compiles what the
    load uses), then `round` times every side in turn."""

    def __init__(self, sides: dict, load):
        self.sides, self.load = sides, load
        for scheduler in sides.values():
            load(scheduler)
        self.results = {k: [] for k in sides}

    def round(self) -> None:
        for k, scheduler in self.sides.items():
            self.results[k].append(self.load(scheduler))


def capacity(engine: Engine, st: dict) -> int:
    slots, max_len = st["kv"]
    requests = slots * max_len // st["request_len"]  # as many as the positions hold
    scheduler = Counting(engine, slots=requests, max_len=max_len, kv_tokens=slots * max_len)
    half = st["request_len"] // 2
    send(scheduler, prompts(requests, half), half)
    return scheduler.most_decoding


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="small requests, to check the script runs")
    args = ap.parse_args(argv)
    st = SMOKE if args.smoke else FULL
    config = Config(model=preset("tiny")).validate()
    placement = make_placement(config)
    engine = Engine(config, load_params(config, placement), placement)
    short, long = st["max_lens"]
    n, p, o = st["requests"], st["prompt"], st["new"]
    decode = Sides(
        {m: Scheduler(engine, slots=n, max_len=m) for m in (short, long)}, lambda s: tpot_ms(send(s, prompts(n, p), o))
    )
    small, big = st["pools"]
    pool = Sides(
        {k: Scheduler(engine, slots=n, max_len=short, kv_tokens=k) for k in (small, big)},
        lambda s: tpot_ms(send(s, prompts(n, p), o)),
    )
    seeds = itertools.count(1)

    def one_at_a_time(s: Scheduler) -> tuple[float, int]:
        """(mean TTFT ms, positions prefilled) of prompts sharing their first tokens, sent one at a
        time; each load's prefix is new (its first request finds nothing cached)."""
        before, ttft = s.prefilled_tokens, []
        for prompt in prompts(n, st["prefix_prompt"], st["shared"], seed=next(seeds)):
            r = send(s, [prompt], 4)[0]
            ttft.append(r.token_times[0] - r.arrival)
        return 1e3 * float(np.mean(ttft)), s.prefilled_tokens - before

    prefix = Sides(
        {
            cache: Scheduler(engine, slots=2, max_len=st["prefix_prompt"] + 4, prefix_cache=cache)
            for cache in (True, False)
        },
        one_at_a_time,
    )
    for _ in range(args.rounds):
        decode.round()
        pool.round()
        prefix.round()
    mean = {k: float(np.mean(v)) for k, v in decode.results.items()}
    by_pool = {k: float(np.mean(v)) for k, v in pool.results.items()}
    (with_ms, with_tokens), (without_ms, without_tokens) = (np.mean(prefix.results[k], axis=0) for k in (True, False))
    together = capacity(engine, st)
    slots, max_len = st["kv"]
    out = {
        "mean_tpot_ms": {short: round(mean[short], 2), long: round(mean[long], 2)},
        "tpot_ratio": round(mean[long] / mean[short], 2),
        "pool_mean_tpot_ms": {small: round(by_pool[small], 2), big: round(by_pool[big], 2)},
        "pool_tpot_ratio": round(by_pool[big] / by_pool[small], 2),
        "prefix_mean_ttft_ms": {"cached": round(with_ms, 2), "uncached": round(without_ms, 2)},
        "prefix_ttft_ratio": round(with_ms / without_ms, 2),
        "prefill_tokens": {"cached": int(with_tokens), "uncached": int(without_tokens)},
        "decoding_together": together,
        "capacity_vs_slots": together / slots,
        "rounds": args.rounds,
    }
    if args.json:
        print(json.dumps(out))
        return
    run = f"moejax bench --preset tiny --num-prompts {n} --input-len {p} --output-len {o} --slots {n}"
    print(f"{'decode: ' + run:<100}{'mean TPOT ms':>14}")
    for m in (short, long):
        print(f"{'  --max-seq-len ' + str(m):<100}{mean[m]:>14.2f}")
    print(f"{'  ratio':<100}{out['tpot_ratio']:>14.2f}")
    print(f"{'pool: the same, --max-seq-len ' + str(short):<100}{'mean TPOT ms':>14}")
    for k in (small, big):
        print(f"{'  --kv-cache-tokens ' + str(k):<100}{by_pool[k]:>14.2f}")
    print(f"{'  ratio':<100}{out['pool_tpot_ratio']:>14.2f}")
    run = (
        f"moejax bench --preset tiny --num-prompts {n} --input-len {st['prefix_prompt']} --output-len 4 "
        f"--max-concurrency 1 --shared-prefix-len {st['shared']}"
    )
    print(f"{'prefix: ' + run:<100}{'mean TTFT ms':>14}{'prefilled':>11}")
    print(f"{'  (prefix cache on)':<100}{with_ms:>14.2f}{int(with_tokens):>11}")
    print(f"{'  --no-prefix-cache':<100}{without_ms:>14.2f}{int(without_tokens):>11}")
    print(f"{'  ratio':<100}{out['prefix_ttft_ratio']:>14.2f}")
    run = (
        f"capacity: --kv-cache-tokens {slots * max_len} (the memory of --slots {slots} --max-seq-len {max_len}), "
        f"requests of {st['request_len'] // 2} + {st['request_len'] // 2} tokens"
    )
    print(f"{run:<100}{'decode together':>16}")
    print(f"{'  paged (contiguous rows: ' + str(slots) + ')':<100}{together:>16}")


if __name__ == "__main__":
    main()
