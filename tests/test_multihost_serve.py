"""`serve` over two processes (4 virtual CPU devices each, jax.distributed): process 0 answers
HTTP and sends each step's program calls to process 1, and every request gets the tokens one
process of 8 devices gives it, greedy with MTP drafts (the MLA model) or greedy and sampled with
a seed under prefill and decode apart, each mesh spanning both processes (the GQA model), while
continuous batching mixes prefill and decode. SIGTERM on process 0 finishes the requests in
flight, then every process exits 0, and process 0 alone writes `--record`'s trace, the router
picks one process records. A lost follower ends a stream with an error event, fails new
requests with 503 and stops process 0 non-zero."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from served import Server, free_port

pytestmark = pytest.mark.slow  # starts moejax processes

CASES = {  # placement and model: an MLA model with MTP drafts, a GQA one with prefill and decode apart
    "ragged_a2a-mla-mtp": [
        "--placement",
        "ragged_a2a",
        "--preset",
        "tiny",
        "--speculative",
        "mtp",
        "--mtp-init",
        "random",
    ],
    "tensor_sliced-gqa-apart": [
        "--placement",
        "tensor_sliced",
        "--preset",
        "tiny-qwen3-moe",
        "--prefill-placement",
        "ragged_a2a",
        "--prefill-devices",
        "4",
        "--decode-devices",
        "4",
    ],
}
FLAGS = ["--devices", "8", "--slots", "8", "--max-seq-len", "64", "--prefill-chunk", "8"]
SAMPLED = {"ragged_a2a-mla-mtp": False, "tensor_sliced-gqa-apart": True}  # MTP serves greedy requests only
GQA = "tensor_sliced-gqa-apart"
AGAIN = 4  # the SIGTERM test sends the first 4 requests again


def bodies(case: str) -> list[dict]:
    """12 requests of mixed prompt lengths: greedy, or 8 greedy and 4 sampled with their own seeds."""
    out = []
    for i in range(12):
        body = {"prompt": [(7 * i + j) % 90 + 1 for j in range(3 + 2 * i)], "max_tokens": 6 + i % 4, "temperature": 0}
        if SAMPLED[case] and i % 3 == 2:
            body.update(temperature=0.9, top_p=0.9, seed=100 + i)
        out.append(body)
    return out


def one_process(case: str) -> tuple[list[list[int]], dict]:
    """The tokens of `bodies()` through one process's scheduler over all 8 devices, and the router
    picks it records (`picked_rows`) serving them, then the first `AGAIN` again."""
    from moejax.base.trace import load_trace
    from moejax.cli import build_parser
    from moejax.serving.commands import build_scheduler
    from moejax.serving.metrics import TraceRecorder
    from moejax.serving.request import Request
    from moejax.serving.stopping import Stopper

    args = build_parser().parse_args(["serve", *CASES[case], *FLAGS])
    scheduler = build_scheduler(args, progress=False)[0]
    recorder = TraceRecorder(scheduler, "one process")

    def run(some: list[dict]) -> list[list[int]]:
        requests = [
            Request(
                b["prompt"],
                b["max_tokens"],
                Stopper(None),
                temperature=b["temperature"],
                top_p=b.get("top_p", 1.0),
                seed=b.get("seed", 0),
            )
            for b in some
        ]
        return [r.tokens for r in scheduler.run_all(requests)]

    tokens = run(bodies(case))
    run(bodies(case)[:AGAIN])
    if not recorder.passes:  # MTP's programs return no picks
        return tokens, {}
    path = f"{os.environ.get('TMPDIR', '/tmp')}/moejax-one-process-{os.getpid()}.npz"
    recorder.save(path)
    try:
        return tokens, picked_rows(load_trace(path))
    finally:
        os.remove(path)


def picked_rows(trace) -> dict[str, list[bytes]]:
    """A trace's picks [L, k] of each real row, by pass kind, sorted: what the requests computed,
    whichever rows and passes their arrival times put them in."""
    out: dict[str, list[bytes]] = {}
    for s, kind in enumerate(trace.kind.tolist()):
        out.setdefault(kind, []).extend(trace.ids[s, :, r].tobytes() for r in np.flatnonzero(trace.valid[s]))
    return {kind: sorted(rows) for kind, rows in out.items()}


class TwoProcesses(Server):
    """Process 0 (HTTP) and process 1 (follower) of one server."""

    def __init__(self, case: str, record: str | None = None):
        """`record`: process 0's `--record` path (process 1's is `record` + ".follower")."""
        coordinator = f"127.0.0.1:{free_port()}"
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
        env = dict(os.environ, XLA_FLAGS=" ".join(flags))
        self.port, self.api_key = free_port(), None
        common = [
            sys.executable,
            "-m",
            "moejax",
            "serve",
            *CASES[case],
            *FLAGS,
            "--num-processes",
            "2",
            "--coordinator",
            coordinator,
            "--port",
            str(self.port),
        ]
        self.record = record
        records = (["--record", record], ["--record", f"{record}.follower"]) if record else ([], [])
        self.follower = subprocess.Popen(
            common + ["--process-id", "1", *records[1]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.proc = subprocess.Popen(
            common + ["--process-id", "0", *records[0]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.wait_healthy(600)

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


def start(case: str, record: str | None = None):
    """(server, one process's tokens and picks, the server's answers to the 12 requests sent at once)."""
    expected = one_process(case)
    server = TwoProcesses(case, record)
    return server, expected, concurrently(server, bodies(case))


@pytest.fixture(scope="module")
def mla():
    served = start("ragged_a2a-mla-mtp")
    yield served
    served[0].stop()


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    served = start("tensor_sliced-gqa-apart", str(tmp_path_factory.mktemp("record") / "live.npz"))
    yield served
    served[0].stop()


# Fixtures by case, not a parametrized fixture: the last tests stop their server, and must run last.
@pytest.fixture(params=["mla", "gqa"])
def served(request):
    return request.getfixturevalue(request.param)


def test_concurrent_requests_get_the_tokens_of_one_process(served):
    _, (expected, _), answers = served
    assert [s for s, _ in answers] == [200] * 12, answers
    assert [json.loads(raw)["choices"][0]["token_ids"] for _, raw in answers] == expected


def test_continuous_batching_mixes_prefill_and_decode_across_processes(served):
    server = served[0]
    assert server.metric("moejax_mixed_steps") > 0
    assert server.metric("moejax_step_plan_bytes_total") > 0


def test_sigterm_on_process_0_finishes_the_requests_in_flight_then_every_process_exits_0(gqa):
    server, (expected, _), _ = gqa
    answers = []
    clients = threading.Thread(target=lambda: answers.extend(concurrently(server, bodies(GQA)[:AGAIN])))
    clients.start()
    deadline = time.monotonic() + 60
    while server.metric("moejax_requests_running") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    clients.join()
    assert [json.loads(raw)["choices"][0]["token_ids"] for _, raw in answers] == expected[:AGAIN]
    assert (server.proc.wait(timeout=60), server.follower.wait(timeout=60)) == (0, 0)


def test_record_is_written_by_process_0_alone_with_the_picks_one_process_records(gqa):
    """After the SIGTERM test: the server has served the 12 requests, then the first 4 again."""
    from moejax.base.trace import load_trace

    server, (_, picks), _ = gqa
    assert server.proc.wait(timeout=60) == 0
    assert not os.path.exists(server.record + ".follower")
    assert picked_rows(load_trace(server.record)) == picks


def test_a_lost_follower_ends_streams_with_an_error_and_fails_new_requests_with_503(mla):
    server = mla[0]
    streamed = []
    body = {"prompt": [3, 1, 4, 1, 5], "max_tokens": 50, "temperature": 0, "stream": True}
    client = threading.Thread(target=lambda: streamed.append(server.request("POST", "/v1/completions", body)))
    client.start()
    deadline = time.monotonic() + 60
    while server.metric("moejax_requests_running") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.follower.kill()
    client.join()
    status, raw = streamed[0]
    events = [line[len("data: ") :] for line in raw.decode().split("\n\n") if line]
    assert status == 200 and "lost process 1" in json.loads(events[-1])["error"]["message"], raw
    deadline = time.monotonic() + 60
    while server.request("GET", "/health")[0] == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    status, raw = server.request("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    assert status == 503 and b"lost process 1" in raw, raw
    assert server.proc.wait(timeout=60) != 0
