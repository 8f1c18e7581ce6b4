"""OpenAI-compatible request bodies -> scheduler requests, and the response shapes.

Checks every field a client sends and raises UsageError with one line for anything wrong (the
server answers 400 with it). Extensions as vLLM names them: `top_k`, `stop_token_ids`,
`ignore_eos`, and `token_ids` in each choice.
"""

from __future__ import annotations

import random
import time
import uuid

from moejax.errors import UsageError
from moejax.serving.scheduler import Request
from moejax.serving.stopping import Stopper

DEFAULT_MAX_TOKENS = 16


def _field(body: dict, name: str, kinds, default):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise UsageError(f"'{name}' must be {_names(kinds)}, got {value!r}")
    if not isinstance(value, kinds):
        raise UsageError(f"'{name}' must be {_names(kinds)}, got {type(value).__name__}")
    return value


def _names(kinds) -> str:
    return " or ".join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))


def _int_list(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise UsageError(f"'{name}' must be a list of integers")
    return value


def prompt_ids(body: dict, tokenizer, chat: bool) -> list[int]:
    """The prompt's token ids: chat `messages`, or `prompt` as text or token ids."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise UsageError("'messages' must be a non-empty list of {\"role\": str, \"content\": str}")
        if tokenizer is None:
            raise UsageError("chat needs a tokenizer with a chat template; this server has no tokenizer")
        return tokenizer.encode_chat([{"role": m["role"], "content": m["content"]} for m in messages])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if tokenizer is None:
            raise UsageError("this server has no tokenizer: give 'prompt' as a list of token ids")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list):
        return _int_list(prompt, "prompt")
    raise UsageError("'prompt' must be a string or a list of token ids (one prompt per request)")


def to_request(body: dict, *, tokenizer, eos_ids, chat: bool) -> tuple[Request, bool]:
    """A scheduler request from a (completions or chat) body, and whether to stream."""
    if not isinstance(body, dict):
        raise UsageError("the request body must be a JSON object")
    ids = prompt_ids(body, tokenizer, chat)
    max_tokens = _field(body, "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
                        int, DEFAULT_MAX_TOKENS)
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise UsageError("'stop' must be a string or a list of strings")
    stop_ids = _int_list(_field(body, "stop_token_ids", list, []), "stop_token_ids")
    if not _field(body, "ignore_eos", bool, False):
        stop_ids = list(eos_ids) + stop_ids
    if _field(body, "n", int, 1) != 1:
        raise UsageError("only n=1 is supported")
    request = Request(
        prompt=ids, max_tokens=max_tokens, stopper=Stopper(tokenizer, stop_ids, stop),
        temperature=float(_field(body, "temperature", (int, float), 1.0)),
        top_p=float(_field(body, "top_p", (int, float), 1.0)),
        top_k=max(0, _field(body, "top_k", int, 0)),  # vLLM: -1 = off
        seed=_field(body, "seed", int, None) if body.get("seed") is not None else random.getrandbits(31),
    )
    request.seed &= 0x7FFFFFFF
    return request, _field(body, "stream", bool, False)


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(r: Request) -> dict:
    return {"prompt_tokens": len(r.prompt), "completion_tokens": len(r.tokens),
            "total_tokens": len(r.prompt) + len(r.tokens)}


def response(r: Request, rid: str, model: str, chat: bool) -> dict:
    """The whole (non-streamed) answer."""
    choice = {"index": 0, "finish_reason": r.finish_reason, "token_ids": r.tokens, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": r.stopper.text}
    else:
        choice["text"] = r.stopper.text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(r)}


def chunk(rid: str, model: str, chat: bool, token: int | None, delta: str, finish_reason: str | None,
          first: bool = False) -> dict:
    """One server-sent event of a streamed answer (one new token)."""
    choice = {"index": 0, "finish_reason": finish_reason, "token_ids": [] if token is None else [token],
              "logprobs": None}
    if chat:
        choice["delta"] = {"role": "assistant", "content": delta} if first else {"content": delta}
    else:
        choice["text"] = delta
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice]}
