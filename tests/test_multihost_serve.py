"""`serve` over two processes (4 virtual CPU devices each, jax.distributed): process 0 answers
HTTP and sends each step's program calls to process 1, and every request gets the tokens one
process of 8 devices gives it, greedy or sampled with a seed, while continuous batching mixes
prefill and decode. A lost follower fails the requests with 503 and stops process 0 non-zero;
SIGTERM on process 0 finishes the requests in flight, then every process exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from served import Server, free_port

pytestmark = pytest.mark.slow  # starts moejax processes

CASES = {  # placement and model: an MLA and a GQA tiny preset
    "ragged_a2a-mla": ["--placement", "ragged_a2a", "--preset", "tiny"],
    "tensor_sliced-gqa": ["--placement", "tensor_sliced", "--preset", "tiny-qwen3-moe"],
}
FLAGS = ["--devices", "8", "--slots", "8", "--max-seq-len", "64", "--prefill-chunk", "8"]


def bodies() -> list[dict]:
    """12 requests of mixed prompt lengths: 8 greedy, 4 sampled with their own seeds."""
    out = []
    for i in range(12):
        body = {"prompt": [(7 * i + j) % 90 + 1 for j in range(3 + 2 * i)], "max_tokens": 6 + i % 4, "temperature": 0}
        if i % 3 == 2:
            body.update(temperature=0.9, top_p=0.9, seed=100 + i)
        out.append(body)
    return out


def one_process(case: str) -> list[list[int]]:
    """The tokens of `bodies()` through one process's scheduler over all 8 devices."""
    from moejax.cli import build_parser
    from moejax.serving.commands import build_scheduler
    from moejax.serving.request import Request
    from moejax.serving.stopping import Stopper

    args = build_parser().parse_args(["serve", *CASES[case], *FLAGS])
    scheduler = build_scheduler(args, progress=False)[0]
    requests = [Request(b["prompt"], b["max_tokens"], Stopper(None), temperature=b["temperature"],
                        top_p=b.get("top_p", 1.0), seed=b.get("seed", 0)) for b in bodies()]
    return [r.tokens for r in scheduler.run_all(requests)]


class TwoProcesses(Server):
    """Process 0 (HTTP) and process 1 (follower) of one server."""

    def __init__(self, case: str):
        coordinator = f"127.0.0.1:{free_port()}"
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
        env = dict(os.environ, XLA_FLAGS=" ".join(flags))
        self.port, self.api_key = free_port(), None
        common = [sys.executable, "-m", "moejax", "serve", *CASES[case], *FLAGS, "--num-processes", "2",
                  "--coordinator", coordinator, "--port", str(self.port)]
        self.follower = subprocess.Popen(common + ["--process-id", "1"], stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, env=env)
        self.proc = subprocess.Popen(common + ["--process-id", "0"], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"process 0 exited: {self.proc.stdout.read()[-3000:]}")
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("the two-process server did not come up")

    def stop(self):
        for p in (self.proc, self.follower):
            if p.poll() is None:
                p.kill()
                p.wait()


def concurrently(server, requests: list[dict]) -> list[tuple[int, bytes]]:
    out = [None] * len(requests)

    def send(i):
        out[i] = server.request("POST", "/v1/completions", requests[i], timeout=300)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def start(case: str):
    """(server, one process's tokens, the server's answers to the 12 requests sent at once)."""
    expected = one_process(case)
    server = TwoProcesses(case)
    return server, expected, concurrently(server, bodies())


@pytest.fixture(scope="module")
def mla():
    served = start("ragged_a2a-mla")
    yield served
    served[0].stop()


@pytest.fixture(scope="module")
def gqa():
    served = start("tensor_sliced-gqa")
    yield served
    served[0].stop()


# Fixtures by case, not a parametrized fixture: the last tests stop their server, and must run last.
@pytest.fixture(params=["mla", "gqa"])
def served(request):
    return request.getfixturevalue(request.param)


def test_concurrent_requests_get_the_tokens_of_one_process(served):
    _, expected, answers = served
    assert [s for s, _ in answers] == [200] * 12, answers
    assert [json.loads(raw)["choices"][0]["token_ids"] for _, raw in answers] == expected


def test_continuous_batching_mixes_prefill_and_decode_across_processes(served):
    server = served[0]
    assert server.metric("moejax_mixed_steps") > 0
    assert server.metric("moejax_step_plan_bytes_total") > 0


def test_sigterm_on_process_0_finishes_the_requests_in_flight_then_every_process_exits_0(mla):
    server, expected, _ = mla
    answers = []
    clients = threading.Thread(target=lambda: answers.extend(concurrently(server, bodies()[:4])))
    clients.start()
    deadline = time.monotonic() + 60
    while server.metric("moejax_requests_running") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    clients.join()
    assert [json.loads(raw)["choices"][0]["token_ids"] for _, raw in answers] == expected[:4]
    assert (server.proc.wait(timeout=60), server.follower.wait(timeout=60)) == (0, 0)


def test_a_lost_follower_fails_requests_with_503_and_stops_process_0(gqa):
    server = gqa[0]
    server.follower.kill()
    deadline = time.monotonic() + 60
    while server.request("GET", "/health")[0] == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    status, raw = server.request("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    assert status == 503 and b"lost process 1" in raw, raw
    assert server.proc.wait(timeout=60) != 0
