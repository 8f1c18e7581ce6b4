"""The OpenAI response shapes of a finished (or streamed) `Job`, logprobs included.

Completions logprobs: {tokens, token_logprobs, top_logprobs, text_offset} (with echo the prompt's
tokens first, the first one's logprob null; top_logprobs maps each of the best N and the chosen
token to its logprob). Chat logprobs: {content: [{token, logprob, bytes, top_logprobs: [...]}]}.
A token's string is its decoded text, or "token_id:N" on a server without a tokenizer (vLLM's).
"""

from __future__ import annotations

import time
import uuid

from moejax.serving.openai import Job
from moejax.serving.request import Request


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"


def usage(job: Job) -> dict:
    prompt = sum(len(r.prompt) for r in job.submit)  # each prompt once, whatever n
    completion = sum(len(r.tokens) for r in job.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(entries: list, tokens: list[int], tokenizer, offset: int = 0) -> dict:
    """entries: per token (logprob, [(id, logprob)] best first), or None (echo's first prompt token)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        text = token_text(tokenizer, token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        logprob, top = entry
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append({**{token_text(tokenizer, t): v for t, v in top}, text: logprob})
    return out


def chat_logprobs(entries: list, tokens: list[int], tokenizer) -> dict:
    def item(token: int, logprob: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**item(t, lp), "top_logprobs": [item(a, v) for a, v in top]} for t, (lp, top) in zip(tokens, entries)
        ]
    }


def _choice(job: Job, index: int, r: Request, tokenizer) -> dict:
    choice = {"index": index, "finish_reason": r.finish_reason, "token_ids": r.tokens, "logprobs": None}
    if job.chat:
        choice["message"] = {"role": "assistant", "content": r.stopper.text}
        if job.logprobs is not None:
            choice["logprobs"] = chat_logprobs(r.token_logprobs, r.tokens, tokenizer)
        return choice
    prompt_text = tokenizer.decode(r.prompt) if job.echo and tokenizer is not None else ""
    choice["text"] = prompt_text + r.stopper.text
    if job.logprobs is not None:
        tokens, entries = r.tokens, r.token_logprobs
        if job.echo:
            tokens, entries = r.prompt + tokens, [None] + r.prompt_logprobs + entries
        choice["logprobs"] = completion_logprobs(entries, tokens, tokenizer)
    return choice


def response(job: Job, rid: str, model: str, tokenizer) -> dict:
    """The whole (non-streamed) answer."""
    return {
        "id": rid,
        "object": "chat.completion" if job.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(job, i, r, tokenizer) for i, r in enumerate(job.choices)],
        "usage": usage(job),
    }


def chunk(
    job: Job,
    rid: str,
    model: str,
    index: int,
    token: int | None,
    delta: str,
    done: bool,
    seen: int,
    offset: int,
    tokenizer,
) -> dict:
    """One server-sent event of a streamed answer: choice `index`'s token number `seen` (0 first;
    None: none, the end) whose text starts at `offset` of the choice's text."""
    r = job.choices[index]
    choice = {
        "index": index,
        "finish_reason": r.finish_reason if done else None,
        "token_ids": [] if token is None else [token],
        "logprobs": None,
    }
    if job.logprobs is not None and token is not None:
        entry = [r.token_logprobs[seen]]
        choice["logprobs"] = (
            chat_logprobs(entry, [token], tokenizer)
            if job.chat
            else completion_logprobs(entry, [token], tokenizer, offset)
        )
    if job.chat:
        choice["delta"] = {"role": "assistant", "content": delta} if seen == 0 else {"content": delta}
    else:
        choice["text"] = delta
    return {
        "id": rid,
        "object": "chat.completion.chunk" if job.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
