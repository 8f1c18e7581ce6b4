"""`moejax bench`: a load generator in the manner of `vllm bench serve` / `sglang.bench_serving`.

Random prompts of --input-len token ids, --output-len tokens each (end-of-sequence ignored, so
every request produces exactly that many), sent with Poisson arrivals at --request-rate and/or
at most --max-concurrency in flight, to a server (--url, streamed completions) or to an
in-process scheduler. Each request's token times give TTFT (arrival to first token), TPOT (mean
time per later token), ITL (every gap between tokens) and end-to-end latency.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import json
import threading
import time
import urllib.parse

import numpy as np

from moejax.base.errors import UsageError


@dataclasses.dataclass
class Outcome:
    ok: bool
    start: float = 0.0
    token_times: list[float] = dataclasses.field(default_factory=list)  # one per output token
    tokens: list[int] = dataclasses.field(default_factory=list)  # the generated token ids (when the server sends them)
    error: str = ""


class HTTPClient:
    """Streams completions from an OpenAI-compatible server; a token's time is its chunk's."""

    def __init__(self, url: str, api_key: str | None, timeout: float = 600):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise UsageError(f"--url {url!r} is not an http(s) URL")
        self.u, self.timeout = u, timeout
        self.headers = {
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {api_key}"} if api_key else {}),
        }

    def _conn(self):
        cls = http.client.HTTPSConnection if self.u.scheme == "https" else http.client.HTTPConnection
        return cls(self.u.hostname, self.u.port, timeout=self.timeout)

    def model_info(self) -> dict:
        conn = self._conn()
        try:
            conn.request("GET", self.u.path.rstrip("/") + "/v1/models", headers=self.headers)
            r = conn.getresponse()
            body = r.read()
        except OSError as e:
            raise UsageError(f"cannot reach {self.u.geturl()}: {e}") from None
        finally:
            conn.close()
        if r.status != 200:
            raise UsageError(f"{self.u.geturl()}/v1/models answered {r.status}: {body[:200].decode(errors='replace')}")
        return json.loads(body)["data"][0]

    def send(self, prompt: list[int], max_tokens: int, model: str) -> Outcome:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        out = Outcome(ok=False, start=time.perf_counter())
        conn = self._conn()
        try:
            conn.request(
                "POST", self.u.path.rstrip("/") + "/v1/completions", body=json.dumps(body), headers=self.headers
            )
            r = conn.getresponse()
            if r.status != 200:
                out.error = f"HTTP {r.status}: {r.read()[:200].decode(errors='replace')}"
                return out
            for line in r:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                now = time.perf_counter()
                choices = json.loads(line[6:]).get("choices") or [{}]
                ids = choices[0].get("token_ids") or []
                out.token_times += [now] * max(1, len(ids))
                out.tokens += ids
            out.ok = True
        except OSError as e:
            out.error = str(e)
        finally:
            conn.close()
        return out


class LocalClient:
    """Submits to an in-process scheduler running on its own engine thread."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.thread = threading.Thread(target=scheduler.run, daemon=True)
        self.thread.start()

    def model_info(self) -> dict:
        return {"id": "local", "vocab_size": self.scheduler.engine.c.vocab_size}

    def send(self, prompt: list[int], max_tokens: int, model: str) -> Outcome:
        from moejax.serving.scheduler import Request
        from moejax.serving.stopping import Stopper

        done = threading.Event()
        r = Request(prompt, max_tokens, Stopper(None), on_event=lambda token, delta, finished: finished and done.set())
        out = Outcome(ok=True, start=r.arrival)
        self.scheduler.submit(r)
        done.wait()
        out.token_times, out.tokens = r.token_times, r.tokens
        return out

    def close(self) -> None:
        self.scheduler.drain()
        self.thread.join()


def run(
    client,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    request_rate: float,
    max_concurrency: int | None,
    seed: int = 0,
    progress: bool = True,
    shared_prefix_len: int = 0,
) -> dict:
    """Sends the load and returns the summary (`summarize`); every prompt starts with the same
    `shared_prefix_len` tokens (a shared system prompt)."""
    from tqdm import tqdm

    info = client.model_info()
    rng = np.random.default_rng(seed)
    low = min(10, info["vocab_size"] - 1)  # keep clear of the usual special ids
    prompts = rng.integers(low, info["vocab_size"], (num_prompts, input_len))
    prompts[:, :shared_prefix_len] = prompts[0, :shared_prefix_len]
    prompts = prompts.tolist()
    gaps = rng.exponential(1.0 / request_rate, num_prompts) if np.isfinite(request_rate) else np.zeros(num_prompts)
    workers = max_concurrency or num_prompts
    with (
        tqdm(total=num_prompts, desc="bench", disable=None if progress else True) as bar,
        concurrent.futures.ThreadPoolExecutor(workers) as pool,
    ):

        def one(prompt):
            out = client.send(prompt, output_len, info["id"])
            bar.update()
            return out

        t0 = time.perf_counter()
        futures = []
        for prompt, gap in zip(prompts, gaps):
            time.sleep(gap)
            futures.append(pool.submit(one, prompt))
        outcomes = [f.result() for f in futures]
        duration = time.perf_counter() - t0
    return summarize(outcomes, duration, input_len)


def _stats(name: str, values_s: list[float]) -> dict:
    ms = np.asarray(values_s, np.float64) * 1e3
    if not ms.size:
        ms = np.zeros(1)
    return {
        f"mean_{name}_ms": float(ms.mean()),
        **{f"p{q}_{name}_ms": float(np.percentile(ms, q)) for q in (50, 90, 99)},
    }


def summarize(outcomes: list[Outcome], duration: float, input_len: int) -> dict:
    ok = [o for o in outcomes if o.ok and o.token_times]
    out_tokens = sum(len(o.token_times) for o in ok)
    ttft = [o.token_times[0] - o.start for o in ok]
    tpot = [(o.token_times[-1] - o.token_times[0]) / (len(o.token_times) - 1) for o in ok if len(o.token_times) > 1]
    itl = [b - a for o in ok for a, b in zip(o.token_times, o.token_times[1:])]
    e2e = [o.token_times[-1] - o.start for o in ok]
    failed = [o.error for o in outcomes if o not in ok]
    return {
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0] if failed else None,
        "duration_s": duration,
        "total_input_tokens": input_len * len(ok),
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + input_len * len(ok)) / duration,
        "outputs": [o.tokens for o in outcomes],  # each request's generated token ids, in sending order
        **_stats("ttft", ttft),
        **_stats("tpot", tpot),
        **_stats("itl", itl),
        **_stats("e2e_latency", e2e),
    }


def table(s: dict) -> str:
    rows = [
        ("Successful requests", s["completed"], "d"),
        ("Failed requests", s["failed"], "d"),
        ("Benchmark duration (s)", s["duration_s"], ".2f"),
        ("Total input tokens", s["total_input_tokens"], "d"),
        ("Total generated tokens", s["total_output_tokens"], "d"),
        ("Request throughput (req/s)", s["request_throughput"], ".2f"),
        ("Output token throughput (tok/s)", s["output_throughput"], ".2f"),
        ("Total token throughput (tok/s)", s["total_token_throughput"], ".2f"),
    ]
    lines = [f"{' moejax bench ':=^52}"] + [f"{k:<38}{v:>14{f}}" for k, v, f in rows]
    for name, title in (
        ("ttft", "Time to first token"),
        ("tpot", "Time per output token (excl. 1st)"),
        ("itl", "Inter-token latency"),
        ("e2e_latency", "End-to-end latency"),
    ):
        lines.append(f"{' ' + title + ' ':-^52}")
        lines += [
            f"{label + ' ' + name.upper().replace('_LATENCY', '') + ' (ms)':<38}{s[f'{key}_{name}_ms']:>14.2f}"
            for label, key in (("Mean", "mean"), ("P50", "p50"), ("P90", "p90"), ("P99", "p99"))
        ]
    if s["first_error"]:
        lines.append(f"first error: {s['first_error']}")
    return "\n".join(lines + ["=" * 52])
