"""The text side of a transformers model directory, without torch or transformers.

`tokenizer.json` goes through the `tokenizers` library, the chat template (from
`chat_template.jinja` or `tokenizer_config.json`) through a sandboxed `jinja2` environment set up
as transformers sets its own, and the end-of-sequence ids come from `generation_config.json`, else
`config.json` (one id or a list).
"""

from __future__ import annotations

import json
from pathlib import Path

from moejax.base.errors import UsageError


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path}: {e}") from None


def eos_ids(directory: str | Path) -> tuple[int, ...] | None:
    """End-of-sequence ids of a model directory: generation_config.json's, else config.json's;
    None when neither names any."""
    directory = Path(directory)
    for name in ("generation_config.json", "config.json"):
        value = _read_json(directory / name).get("eos_token_id")
        if value is not None:
            return tuple(int(v) for v in (value if isinstance(value, list) else [value]))
    return None


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(directory: Path, config: dict) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


class Tokenizer:
    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for a malformed file
            raise UsageError(f"cannot load {path}: {str(e).splitlines()[0]}") from None
        config = _read_json(directory / "tokenizer_config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = _chat_template(directory, config)
        ids = eos_ids(directory)
        if ids is None and self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            ids = (self._tok.token_to_id(self.eos_token),)  # the model files name none: the tokenizer's
        self.eos_ids = ids or ()

    @classmethod
    def from_dir(cls, directory: str | Path | None) -> Tokenizer | None:
        """The directory's tokenizer, or None when it has no tokenizer.json (ids-only use)."""
        if directory is None or not (Path(directory) / "tokenizer.json").is_file():
            return None
        return cls(directory)

    @classmethod
    def for_run(cls, tokenizer_dir: str | None, model_dir: str | None) -> Tokenizer | None:
        """--tokenizer DIR (which must hold tokenizer.json), else the model directory's if it has one."""
        if tokenizer_dir is not None and not (Path(tokenizer_dir) / "tokenizer.json").is_file():
            raise UsageError(f"--tokenizer {tokenizer_dir}: no tokenizer.json there")
        return cls.from_dir(tokenizer_dir or model_dir)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages` ([{"role": ..., "content": ...}])."""
        if not self.chat_template:
            raise UsageError("this model's tokenizer has no chat template")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise UsageError(f"chat template: {message}")

        # As transformers renders templates: trimmed blocks, `raise_exception`, unescaped tojson.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise UsageError(f"chat template: {e}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template writes its own special tokens (BOS and turn markers).
        return self.encode(self.render_chat(messages), add_special_tokens=False)
