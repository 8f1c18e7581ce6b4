"""`moejax serve` over HTTP: concurrency, streaming, errors, auth, queue limits, SIGTERM, record.

Servers run as `python -m moejax serve` subprocesses on 127.0.0.1 (module-scoped: started once).
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import numpy as np
import pytest
from served import KEY, MAX_LEN, Server
from text_model import make_text_model

from moejax.base.trace import load_trace

pytestmark = pytest.mark.slow  # starts servers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("text_model"), eos_token_id=[])


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir, "--slots", "8", "--max-queue", "128")
    yield s
    s.stop()


def mixed_requests(n: int = 64) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "prompt": rng.integers(3, 96, rng.integers(1, 40)).tolist(),
            "max_tokens": int(rng.integers(1, 12)),
            "temperature": 0,
        }
        for _ in range(n)
    ]


def concurrently(server, bodies: list[dict]) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(server.complete, bodies))


@pytest.fixture(scope="module")
def alone(server):
    """Each request's greedy tokens when it runs with no other request on the server."""
    return [server.complete(b)["choices"][0]["token_ids"] for b in mixed_requests()]


def test_64_concurrent_requests_each_equal_it_alone(server, alone):
    out = concurrently(server, mixed_requests())
    assert [o["choices"][0]["token_ids"] for o in out] == alone
    assert [o["usage"]["completion_tokens"] for o in out] == [b["max_tokens"] for b in mixed_requests()]


def test_concurrent_requests_under_ragged_a2a_on_8_devices_equal_one_device_alone(model_dir, alone):
    s = Server(model_dir, "--slots", "16", "--devices", "8", "--placement", "ragged_a2a")
    try:
        out = concurrently(s, mixed_requests())
    finally:
        s.stop()
    assert [o["choices"][0]["token_ids"] for o in out] == alone


def stream(server, body: dict, chat: bool) -> list[dict]:
    status, raw = server.request(
        "POST", "/v1/chat/completions" if chat else "/v1/completions", {**body, "stream": True}
    )
    assert status == 200
    events = [line[len("data: ") :] for line in raw.decode().split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


SAMPLED = {"temperature": 0.9, "top_p": 0.9, "top_k": 50}


def test_sampled_request_is_the_same_through_generate_serve_alone_and_amid_seven_others(server, model_dir, capsys):
    """`generate --sample-seed 11` with two prompts: prompt i samples as a request of seed 11 + i."""
    from moejax.cli import main

    prompts = ["hello there", "a second prompt"]
    args = [
        "generate",
        "--hf",
        str(model_dir),
        "--max-new-tokens",
        "12",
        "--json",
        "--sample-seed",
        "11",
        "--temperature",
        "0.9",
        "--top-p",
        "0.9",
        "--top-k",
        "50",
    ]
    assert main(args + [x for p in prompts for x in ("--prompt", p)]) == 0
    generated = json.loads(capsys.readouterr().out)["tokens"]
    bodies = [{"prompt": p, "max_tokens": 12, "seed": 11 + i, **SAMPLED} for i, p in enumerate(prompts)]
    alone = [server.complete(b)["choices"][0]["token_ids"] for b in bodies]
    others = [{"prompt": f"other {i}", "max_tokens": 12, "seed": 100 + i, **SAMPLED} for i in range(7)]
    amid = concurrently(server, [bodies[0]] + others)[0]["choices"][0]["token_ids"]
    assert generated == alone and amid == alone[0]
    seeded = concurrently(server, [{**bodies[0], "seed": s} for s in range(4)])
    assert len({tuple(o["choices"][0]["token_ids"]) for o in seeded}) > 1  # it did sample


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_chunks_concatenate_to_the_whole_answer(server, chat):
    body = {
        "max_tokens": 12,
        "temperature": 0,
        "stop": ["zz"],
        **({"messages": [{"role": "user", "content": "hello"}]} if chat else {"prompt": "hello"}),
    }
    whole = server.complete(body, chat)["choices"][0]
    chunks = [c["choices"][0] for c in stream(server, body, chat)]
    text = "".join(c["delta"]["content"] if chat else c["text"] for c in chunks)
    assert text == (whole["message"]["content"] if chat else whole["text"])
    assert sum((c["token_ids"] for c in chunks), []) == whole["token_ids"]
    assert chunks[-1]["finish_reason"] == whole["finish_reason"]


@pytest.mark.parametrize(
    "body, message",
    [
        ("{not json", "not valid JSON"),
        ({"prompt": [5] * MAX_LEN}, "does not fit"),
        ({"prompt": "hi", "model": "gpt-4"}, "not served here"),
        ({"prompt": "hi", "max_tokens": "many"}, "'max_tokens' must be int"),
        ({"prompt": [3, 500]}, "outside the vocabulary"),
    ],
)
def test_bad_request_gets_400_with_one_line(server, body, message):
    status, raw = server.request("POST", "/v1/completions", body)
    assert status == 400 and b"\n" not in raw.strip()
    assert message in json.loads(raw)["error"]["message"]


@pytest.mark.parametrize("key", [None, "wrong"])
def test_missing_or_wrong_api_key_gets_401_and_runs_nothing(server, key):
    before = server.metric("moejax_prompt_tokens_total")
    status, raw = server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=key)
    assert status == 401 and "API key" in json.loads(raw)["error"]["message"]
    assert server.request("GET", "/v1/models", key=key)[0] == 401
    assert server.metric("moejax_prompt_tokens_total") == before


def test_health_needs_no_key(server):
    assert server.request("GET", "/health", key=None)[0] == 200


def test_models_lists_the_served_model(server, model_dir):
    (model,) = json.loads(server.request("GET", "/v1/models")[1])["data"]
    assert model["id"] == str(model_dir) and model["max_model_len"] == MAX_LEN


def test_metrics_count_tokens_latencies_and_expert_picks(server):
    names = [
        "moejax_generation_tokens_total",
        "moejax_prompt_tokens_total",
        "moejax_e2e_request_latency_seconds_count",
        "moejax_inter_token_latency_seconds_count",
        "moejax_expert_tokens",
    ]
    before = [server.metric(n) for n in names]
    server.complete({"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
    after = [server.metric(n) for n in names]
    assert [a - b for a, b in zip(after[:4], before[:4])] == [4, 3, 1, 3]
    assert after[4] > 0 and server.metric("moejax_kv_slots_total") == 8


# ----------------------------------------------------------------------------- a one-slot server


@pytest.fixture(scope="module")
def small(model_dir, tmp_path_factory):
    trace = tmp_path_factory.mktemp("record") / "live.npz"
    s = Server(model_dir, "--slots", "1", "--max-queue", "2", "--record", str(trace), api_key=None)
    s.trace = trace
    yield s
    s.stop()


def test_full_queue_gets_429(small):
    bodies = [{"prompt": [5, 6], "max_tokens": 60, "temperature": 0}] * 8
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        statuses = sorted(s for s, _ in pool.map(lambda b: small.request("POST", "/v1/completions", b), bodies))
    # Two waiting are accepted, and a third when the engine has taken one into its slot before the
    # others arrive (a race the requests run against it); the rest find the queue full.
    assert statuses.count(200) in (2, 3) and statuses.count(429) == len(bodies) - statuses.count(200)


def test_sigterm_finishes_every_accepted_request_then_exits(small):
    bodies = [{"prompt": [5, 6, i + 10], "max_tokens": 40, "temperature": 0} for i in range(3)]
    deadline = time.monotonic() + 60

    def wait_for(running: int, waiting: int) -> None:
        while small.metric("moejax_requests_running") < running or small.metric("moejax_requests_waiting") < waiting:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        # The first takes the one slot before the others queue (all at once, the third could find
        # the two queue places taken before the engine has moved the first into its slot).
        futures = [pool.submit(small.complete, bodies[0])]
        wait_for(1, 0)
        futures += [pool.submit(small.complete, b) for b in bodies[1:]]
        wait_for(1, 2)
        small.proc.send_signal(signal.SIGTERM)
        out = [f.result(timeout=120) for f in futures]
    assert [o["usage"]["completion_tokens"] for o in out] == [40] * 3
    # uvicorn re-raises the signal once it has shut down cleanly.
    assert small.proc.wait(timeout=60) in (0, -signal.SIGTERM)


def test_record_writes_the_router_picks_of_live_traffic(small):
    small.complete({"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}) if small.proc.poll() is None else None
    small.stop()
    trace = load_trace(small.trace)
    assert set(trace.kind.tolist()) == {"prefill", "decode"} and trace.valid.sum() > 0


def test_bench_against_the_server_reports_every_request(server, capsys):
    from moejax.cli import main

    url = f"http://127.0.0.1:{server.port}"
    code = main(
        [
            "bench",
            "--url",
            url,
            "--api-key",
            KEY,
            "--num-prompts",
            "12",
            "--input-len",
            "9",
            "--output-len",
            "5",
            "--max-concurrency",
            "4",
            "--json",
        ]
    )
    s = json.loads(capsys.readouterr().out)
    assert code == 0 and (s["completed"], s["failed"], s["total_output_tokens"]) == (12, 0, 60)
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        assert 0 < s[f"p50_{name}_ms"] <= s[f"p90_{name}_ms"] <= s[f"p99_{name}_ms"]
    assert s["mean_ttft_ms"] < s["mean_e2e_latency_ms"]
