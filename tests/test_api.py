"""The OpenAI-compatible API as evaluation harnesses use it: logprobs (completions and chat shapes),
echo, batches of prompts, n, logit_bias, min_tokens, /tokenize, /detokenize, /version, and every
refused field and bad value answered 400. References: transformers on the same model (float32),
lm-evaluation-harness and the official `openai` client run unchanged against `moejax serve`."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from served import MAX_LEN, Server
from text_model import make_text_model

QUESTIONS = [
    ("The cat sat on the", [" mat", " moon", " xq"], 0),
    ("One two three", [" four", " zz", " !"], 1),
    ("abc", [" d", " e f", " g"], 2),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The text model, its end-of-sequence token written as a plain string (AutoTokenizer reads only that)."""
    directory = make_text_model(tmp_path_factory.mktemp("api_model"), eos_token_id=[1])
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "</s>"}))
    return directory


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir, "--slots", "8", api_key=None)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(model_dir):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def hf_logprobs(hf, ids: list[int]) -> np.ndarray:
    """[len(ids), V] the model's log-softmax after each prefix."""
    import torch

    with torch.no_grad():
        logits = hf[0](torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Up to n greedy tokens by transformers' forward, ending at the end-of-sequence id as the
    server does (its `generate` applies the checkpoint's generation config on top)."""
    new = []
    while len(new) < n and (not new or new[-1] != 1):
        new.append(int(hf_logprobs(hf, ids + new)[-1].argmax()))
    return new


def encode(hf, text: str) -> list[int]:
    return hf[1](text, add_special_tokens=False).input_ids


def complete(server, body: dict, path: str = "/v1/completions") -> dict:
    status, raw = server.request("POST", path, body)
    assert status == 200, raw
    return json.loads(raw)


# ----------------------------------------------------------------------------- logprobs and echo


def test_echo_logprobs_are_the_models_log_softmax(server, hf):
    ids = encode(hf, "hello world")
    out = complete(server, {"prompt": ids, "echo": True, "logprobs": 3, "max_tokens": 2, "temperature": 0})
    lp = out["choices"][0]["logprobs"]
    tokens = ids + out["choices"][0]["token_ids"]
    reference = hf_logprobs(hf, tokens)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(
        lp["token_logprobs"][1:], [reference[i - 1, t] for i, t in enumerate(tokens) if i], atol=1e-4
    )
    best = [sorted(row.values(), reverse=True)[:3] for row in lp["top_logprobs"][1:]]
    np.testing.assert_allclose(best, -np.sort(-reference[:-1], axis=-1)[:, :3], atol=1e-4)
    assert lp["tokens"] == [hf[1].decode([t]) for t in tokens] and lp["text_offset"] == list(range(len(tokens)))
    assert out["choices"][0]["text"] == hf[1].decode(ids) + hf[1].decode(out["choices"][0]["token_ids"])


def test_score_gives_the_servers_echo_logprobs(server, model_dir, capsys):
    from moejax.cli import main

    assert main(["score", "--hf", str(model_dir), "--prompt", "hello world", "--top-logprobs", "2", "--json"]) == 0
    (scored,) = json.loads(capsys.readouterr().out)["logprobs"]
    served = complete(server, {"prompt": "hello world", "echo": True, "logprobs": 2, "max_tokens": 0})["choices"][0]
    assert scored["token_logprobs"][0] is None
    np.testing.assert_allclose(scored["token_logprobs"][1:], served["logprobs"]["token_logprobs"][1:], atol=1e-5)
    best = [sorted(top.values(), reverse=True)[:2] for top in served["logprobs"]["top_logprobs"][1:]]
    np.testing.assert_allclose([[v for _, v in top] for top in scored["top_logprobs"][1:]], best, atol=1e-5)


def test_echo_with_max_tokens_0_gives_the_prompt_alone(server, hf):
    ids = encode(hf, "abc")
    choice = complete(server, {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0})["choices"][0]
    assert choice["token_ids"] == [] and len(choice["logprobs"]["token_logprobs"]) == len(ids)


def test_a_list_of_prompts_gives_one_choice_each_in_order(server, hf):
    prompts = ["hello", encode(hf, "abc"), "zz top"]
    out = complete(server, {"prompt": prompts, "max_tokens": 4, "temperature": 0})
    alone = [complete(server, {"prompt": p, "max_tokens": 4, "temperature": 0})["choices"][0] for p in prompts]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in out["choices"]] == [c["token_ids"] for c in alone]


def test_n_samples_are_reproducible_and_prefill_the_prompt_once(server, hf):
    body = {"prompt": "sample me", "max_tokens": 8, "n": 4, "seed": 5, "temperature": 1.0}
    before = server.metric("moejax_prefill_tokens_total")
    first = complete(server, body)
    prompt = first["usage"]["prompt_tokens"]
    assert server.metric("moejax_prefill_tokens_total") - before == prompt
    samples = [c["token_ids"] for c in first["choices"]]
    assert len({tuple(s) for s in samples}) > 1 and [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in complete(server, body)["choices"]] == samples
    # Sample j is the request of seed 5 + j alone.
    assert complete(server, {**body, "n": 1, "seed": 7})["choices"][0]["token_ids"] == samples[2]


def test_logit_bias_forces_a_token(server):
    out = complete(server, {"prompt": "hi", "max_tokens": 5, "temperature": 0, "logit_bias": {"40": 100}})
    assert out["choices"][0]["token_ids"] == [40] * 5


def test_min_tokens_holds_back_the_end_of_sequence(server):
    body = {"prompt": "hi", "max_tokens": 6, "temperature": 0, "logit_bias": {"1": 100}}
    assert complete(server, body)["choices"][0]["token_ids"] == [1]
    held = complete(server, {**body, "min_tokens": 3})["choices"][0]
    assert len(held["token_ids"]) == 4 and held["token_ids"][3] == 1 and held["finish_reason"] == "stop"


def test_streamed_chunks_carry_their_tokens_logprobs(server):
    body = {"prompt": "hello", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    whole = complete(server, body)["choices"][0]["logprobs"]
    status, raw = server.request("POST", "/v1/completions", {**body, "stream": True})
    events = [json.loads(e[len("data: ") :]) for e in raw.decode().split("\n\n") if e and e != "data: [DONE]"]
    pieces = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["token_ids"]]
    assert status == 200
    assert {k: sum((p[k] for p in pieces), []) for k in whole} == whole


# ----------------------------------------------------------------------------- tokenize, version


def test_tokenize_and_detokenize_round_trip(server, hf):
    out = complete(server, {"prompt": "hello"}, "/tokenize")
    assert out["tokens"] == hf[1]("hello").input_ids and out["count"] == 6 and out["max_model_len"] == MAX_LEN
    assert complete(server, {"tokens": out["tokens"]}, "/detokenize")["prompt"] == "hello"


def test_version_answers(server):
    status, raw = server.request("GET", "/version")
    assert status == 200 and json.loads(raw)["version"]


# ----------------------------------------------------------------------------- refused and bad


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "'suffix' is not supported"),
        ("/v1/completions", {"prompt": "hi", "best_of": 3}, "'best_of' 3"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, "'presence_penalty' is not supported"),
        ("/v1/completions", {"prompt": "hi", "frequency_penalty": 1}, "'frequency_penalty' is not supported"),
        ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1.2}, "'repetition_penalty' is not supported"),
        ("/v1/completions", {"prompt": "hi", "min_p": 0.1}, "'min_p' is not supported"),
        ("/v1/completions", {"prompt": "hi", "echo": True, "stream": True}, "'echo' with 'stream'"),
        ("/v1/completions", {"prompt": "hi", "guided_json": {}}, "unknown field 'guided_json'"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
            "'response_format' is not supported",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            "'tools' is not supported",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"},
            "'tool_choice' is not supported",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "echo": True},
            "unknown field 'echo'",
        ),
    ],
)
def test_refused_field_gets_400_naming_it(server, path, body, message):
    status, raw = server.request("POST", path, body)
    assert status == 400 and message in json.loads(raw)["error"]["message"]


@pytest.mark.parametrize(
    "raw, message",
    [
        ('{"prompt": "hi", "temperature": NaN}', "non-finite number NaN"),
        ('{"prompt": "hi", "temperature": Infinity}', "non-finite number Infinity"),
        ('{"prompt": "hi", "top_p": -Infinity}', "non-finite number -Infinity"),
        ('{"prompt": "hi", "temperature": 1e999}', "non-finite number 1e999"),
        (
            '{"prompt": [5, 6], "max_tokens": 100000}',
            f"prompt of 2 tokens + max_tokens 100000 = 100002 exceeds the longest request of {MAX_LEN}",
        ),
        ('{"prompt": "hi", "logprobs": 21}', "'logprobs' must be 0..20"),
        ('{"prompt": "hi", "n": 0}', "'n' must be at least 1"),
        ('{"prompt": "hi", "n": 9}', "n=9 samples need as many slots"),
        ('{"prompt": "hi", "max_tokens": 0}', "0 only with echo"),
        ('{"prompt": "hi", "logit_bias": {"x": 1}}', "'logit_bias' maps token ids"),
        ('{"prompt": "hi", "logit_bias": {"5": 500}}', "'logit_bias' maps token ids"),
        ('{"prompt": "hi", "logit_bias": {"500": 1}}', "logit_bias token id 500 is outside"),
        ('{"prompt": "hi", "min_tokens": 20, "max_tokens": 4}', "'min_tokens' 20 exceeds max_tokens 4"),
        ('{"prompt": [[5, 6], 7]}', "'prompt' must be"),
    ],
)
def test_bad_value_gets_400_with_one_line(server, raw, message):
    status, out = server.request("POST", "/v1/completions", raw)
    assert status == 400 and b"\n" not in out.strip()
    assert message in json.loads(out)["error"]["message"]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30},
            "'top_logprobs' must be 0..20",
        ),
    ],
)
def test_bad_chat_logprobs_get_400(server, body, message):
    status, out = server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and message in json.loads(out)["error"]["message"]


# ----------------------------------------------------------------------------- clients run unchanged


def test_openai_client_completions_and_chat_logprobs(server, hf):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused")
    model = client.models.list().data[0].id
    c = client.completions.create(model=model, prompt="hello", max_tokens=4, temperature=0, logprobs=2).choices[0]
    prompt, new = hf[1]("hello").input_ids, c.to_dict()["token_ids"]  # moejax's and vLLM's extension
    reference = hf_logprobs(hf, prompt + new)
    assert new == hf_greedy(hf, prompt, 4) and c.logprobs.tokens == [hf[1].decode([t]) for t in new]
    np.testing.assert_allclose(c.logprobs.token_logprobs, reference[len(prompt) - 1 : -1].max(-1), atol=1e-4)
    assert all(len(top) == 2 for top in c.logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        n=2,
    ).choices
    ids = hf[1](
        hf[1].apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    ).input_ids
    content = chat[1].logprobs.content
    reference = hf_logprobs(hf, ids + hf_greedy(hf, ids, 3))
    np.testing.assert_allclose([t.logprob for t in content], reference[len(ids) - 1 : -1].max(-1), atol=1e-4)
    np.testing.assert_allclose(
        [[a.logprob for a in t.top_logprobs] for t in content],
        -np.sort(-reference[len(ids) - 1 : -1], axis=-1)[:, :3],
        atol=1e-4,
    )
    assert "".join(t.token for t in content) == chat[0].message.content and len(chat) == 2


TASKS = {
    "moejax_choice": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
    "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n",
    "moejax_until": "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{choices[0]}}'\n"
    "generation_kwargs:\n  until: ['Q:']\n  max_gen_toks: 6\n  do_sample: false\n"
    "metric_list:\n  - metric: exact_match\n",
}


def test_lm_eval_loglikelihood_and_generation_equal_transformers(server, hf, model_dir, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    for task, spec in TASKS.items():
        (tmp_path / f"{task}.yaml").write_text(
            f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n{spec}"
        )
    out = simple_evaluate(
        model="local-completions",
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tmp_path)),
        model_args={
            "base_url": f"http://127.0.0.1:{server.port}/v1/completions",
            "model": str(model_dir),
            "tokenizer_backend": "huggingface",
            "tokenizer": str(model_dir),
            "batch_size": 3,
            "max_retries": 1,
            "num_concurrent": 1,
        },
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    expected_acc = []
    for sample in sorted(out["samples"]["moejax_choice"], key=lambda s: s["doc_id"]):
        question, choices, answer = QUESTIONS[sample["doc_id"]]
        context = encode(hf, question)
        want = []
        for continuation in map(functools.partial(encode, hf), choices):
            lp = hf_logprobs(hf, context + continuation)
            want.append(float(sum(lp[len(context) - 1 + i, t] for i, t in enumerate(continuation))))
        got = [float(r[0]) for r in sample["filtered_resps"]]
        np.testing.assert_allclose(got, want, atol=1e-4)
        expected_acc.append(float(np.argmax(want) == answer))
    assert out["results"]["moejax_choice"]["acc,none"] == pytest.approx(np.mean(expected_acc))
    for sample in sorted(out["samples"]["moejax_until"], key=lambda s: s["doc_id"]):
        text = hf[1].decode(hf_greedy(hf, encode(hf, QUESTIONS[sample["doc_id"]][0]), 6))
        assert sample["filtered_resps"][0] == text.split("Q:")[0]
