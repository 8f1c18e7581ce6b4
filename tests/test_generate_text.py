"""`moejax generate` with text: --prompt, --chat, end-of-sequence ids and --stop."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from text_model import make_text_model

from moejax.cli import main
from moejax.serving.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # runs `moejax generate` end to end

TEXT = "hello world"


def generate(capsys, directory, *args) -> dict:
    assert main(["generate", "--hf", str(directory), "--max-new-tokens", "10", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("text_model"), eos_token_id=[])


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def plain(model_dir) -> dict:
    """`generate --prompt TEXT` on the model, run once for the tests that compare with it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", "--hf", str(model_dir), "--max-new-tokens", "10", "--json", "--prompt", TEXT]) == 0
    return json.loads(out.getvalue())


def test_prompt_text_gives_the_tokens_of_its_ids_and_decoded_text(capsys, model_dir, tok):
    ids = ",".join(map(str, tok.encode(TEXT)))
    out = generate(capsys, model_dir, "--prompt", TEXT, "--prompt-ids", ids)
    assert out["tokens"][0] == out["tokens"][1] and len(out["tokens"][0]) == 10
    assert out["text"][0] == tok.decode(out["tokens"][0])
    assert out["finish_reasons"] == ["length", "length"]


def test_chat_prompt_is_the_rendered_template(capsys, model_dir, tok):
    chat = generate(capsys, model_dir, "--prompt", TEXT, "--chat")
    ids = ",".join(map(str, tok.encode(f"<s>u:{TEXT};a:", add_special_tokens=False)))
    assert chat["tokens"] == generate(capsys, model_dir, "--prompt-ids", ids)["tokens"]


def test_end_of_sequence_id_stops_the_request_early(capsys, plain, tmp_path):
    full = plain["tokens"][0]
    eos = full[5]
    out = generate(capsys, make_text_model(tmp_path, eos_token_id=[90, eos]), "--prompt", TEXT)
    assert out["tokens"][0] == full[: full.index(eos) + 1] and out["finish_reasons"] == ["stop"]
    ignored = generate(capsys, tmp_path, "--prompt", TEXT, "--ignore-eos")
    assert ignored["tokens"][0] == full and ignored["finish_reasons"] == ["length"]


def test_stop_string_ends_the_text_before_it(capsys, model_dir, plain):
    full = plain["text"][0]
    stop = full[4:6]
    out = generate(capsys, model_dir, "--prompt", TEXT, "--stop", stop)
    assert out["text"][0] == full[: full.index(stop)] and out["finish_reasons"] == ["stop"]


def test_text_prompt_without_tokenizer_is_one_usage_line(capsys):
    assert main(["generate", "--preset", "tiny", "--prompt", TEXT]) == 2
    assert capsys.readouterr().err.count("\n") == 1
