"""The text side: a model directory's tokenizer, chat template and end-of-sequence ids, and
`Stopper`'s incremental text."""

from __future__ import annotations

import json

import pytest
from text_model import make_text_model

from moejax.base.errors import UsageError
from moejax.serving.stopping import Stopper
from moejax.serving.tokenizer import Tokenizer, eos_ids


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("text_model"))


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(model_dir)


def test_text_round_trips_and_starts_with_bos(tok):
    ids = tok.encode("Hello, moe world!")
    assert ids[0] == 0 and tok.decode(ids) == "Hello, moe world!"


def test_chat_template_renders_messages_with_generation_prompt(tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.render_chat(messages) == "<s>s:be brief;u:hi;a:"
    assert tok.encode_chat(messages) == tok.encode("s:be brief;u:hi;a:")  # the template's <s>, no second one


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"generation_config.json": {"eos_token_id": [1, 5]}, "config.json": {"eos_token_id": 9}}, (1, 5)),
        ({"generation_config.json": {}, "config.json": {"eos_token_id": 9}}, (9,)),
        ({"generation_config.json": {"eos_token_id": []}, "config.json": {"eos_token_id": 9}}, ()),
        ({"config.json": {"eos_token_id": None}}, None),
    ],
)
def test_eos_ids_from_generation_config_else_config(tmp_path, files, expected):
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    assert eos_ids(tmp_path) == expected


def test_tokenizer_eos_token_when_the_model_files_name_none(tmp_path):
    assert Tokenizer(make_text_model(tmp_path)).eos_ids == (1,)


def test_no_tokenizer_json_means_ids_only(tmp_path):
    assert Tokenizer.from_dir(tmp_path) is None


def test_template_error_is_one_usage_line(tmp_path):
    bad = make_text_model(tmp_path)
    (bad / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ raise_exception('no system role') }}"}))
    with pytest.raises(UsageError, match="no system role"):
        Tokenizer(bad).render_chat([{"role": "user", "content": "x"}])


def feed(stopper, text_ids):
    return [stopper.add(t) for t in text_ids]


def test_stop_string_is_held_back_until_decided_and_never_shown(tok):
    s = Stopper(tok, stop_strings=["XY"])
    deltas = feed(s, tok.encode("abXcXYd", add_special_tokens=False))
    assert deltas[:3] == ["a", "b", ""]  # "X" might start "XY"
    assert "".join(deltas) == "abXc" == s.text and s.finish_reason == "stop"


def test_stop_id_counts_as_a_token_but_not_as_text(tok):
    s = Stopper(tok, stop_ids=[1])
    deltas = feed(s, tok.encode("ok", add_special_tokens=False) + [1])
    assert s.tokens[-1] == 1 and "".join(deltas) == s.text == "ok" and s.finish_reason == "stop"


def test_length_shows_what_was_held(tok):
    s = Stopper(tok, stop_strings=["!?"])
    shown = "".join(feed(s, tok.encode("hey!", add_special_tokens=False)))
    assert shown == "hey" and shown + s.finish_length() == "hey!" and s.finish_reason == "length"


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(UsageError, match="tokenizer"):
        Stopper(None, stop_strings=["x"])


def test_tokenizer_dir_without_tokenizer_json_is_one_usage_line(tmp_path):
    with pytest.raises(UsageError, match="no tokenizer.json"):
        Tokenizer.for_run(str(tmp_path), None)
