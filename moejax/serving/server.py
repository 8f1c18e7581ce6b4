"""The OpenAI-compatible HTTP server: FastAPI on the asyncio thread, the scheduler on its own
engine thread. A handler checks and tokenizes the request, submits it, and awaits the engine's
per-token events through an asyncio queue (fed with `call_soon_threadsafe`).

Shutdown (SIGTERM, handled by uvicorn): the listening socket closes, uvicorn waits for every open
request to finish (the engine keeps running them), then the lifespan's exit drains the scheduler
and stops the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import json
import os
import signal
import sys
import threading
import time
import traceback

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from moejax.base.errors import UsageError
from moejax.serving import openai, responses
from moejax.serving.scheduler import Draining, QueueFull

DISCONNECT_CHECK_S = 1.0  # how often a waiting non-streamed request checks that its client is still there
FAILURE_WAIT_S = 35.0  # over several processes: how long a failed step waits for the lost process to be named


def moejax_version() -> str:
    try:
        return importlib.metadata.version("moejax")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def error(status: int, message: str) -> JSONResponse:
    """One line of JSON, the shape OpenAI clients parse."""
    kinds = {400: "invalid_request_error", 401: "authentication_error", 429: "rate_limit_error"}
    return JSONResponse(
        {"error": {"message": message, "type": kinds.get(status, "server_error"), "code": status}}, status_code=status
    )


class BearerKey:
    """Every endpoint but /health needs `Authorization: Bearer KEY`. Plain ASGI rather than
    FastAPI's http middleware, which hides a client's disconnect from the handlers."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error(401, "missing or wrong API key: send 'Authorization: Bearer KEY'")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(
    scheduler, metrics, *, tokenizer, eos_ids, model_name: str, api_key: str | None = None, on_exit=None, failure=None
) -> FastAPI:
    """on_exit(): called after the engine thread has finished every accepted request.
    failure(): over several processes, None or why the server is down (a lost process; whoever
    finds it fails the requests and exits): /health and every request answer 503."""
    failed = failure or (lambda: None)

    def engine_thread():
        try:
            scheduler.run()
        except BaseException:  # a broken engine cannot answer anything: do not leave clients hanging
            deadline = time.monotonic() + (FAILURE_WAIT_S if failure else 0)
            while failed() is None and time.monotonic() < deadline:  # a collective failed: a process is gone
                time.sleep(0.1)
            if failed() is None:
                traceback.print_exc()
                os._exit(1)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        thread = threading.Thread(target=engine_thread, name="moejax-engine", daemon=True)
        thread.start()
        yield
        scheduler.drain()
        await asyncio.to_thread(thread.join)
        if on_exit is not None:
            on_exit()

    app = FastAPI(title="moejax", lifespan=lifespan)

    if api_key is not None:
        app.add_middleware(BearerKey, key=api_key)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return error(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health():
        return PlainTextResponse("ok") if failed() is None else PlainTextResponse(failed(), status_code=503)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "moejax",
                    "max_model_len": scheduler.max_len,
                    "vocab_size": scheduler.engine.c.vocab_size,
                }
            ],
        }

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def complete(request: HTTPRequest, chat: bool):
        if failed() is not None:
            return error(503, failed())
        try:
            body = openai.load_body(await request.body())
            if isinstance(body, dict) and body.get("model") not in (None, model_name):
                raise UsageError(f"model {body['model']!r} is not served here; this server serves {model_name!r}")
            job = openai.to_job(body, tokenizer=tokenizer, eos_ids=eos_ids, chat=chat, max_len=scheduler.max_len)
            for r in job.submit:
                scheduler.check(r)
            loop, events = asyncio.get_running_loop(), asyncio.Queue()
            for k, r in enumerate(job.choices):
                r.on_event = lambda token, delta, done, k=k: loop.call_soon_threadsafe(
                    events.put_nowait, (k, token, delta, done)
                )
            try:
                for r in job.submit:
                    scheduler.submit(r)
            except (QueueFull, Draining):
                for r in job.choices:  # all of the request or none
                    r.cancelled = True
                raise
        except UsageError as e:
            return error(400, str(e))
        except QueueFull:
            return error(429, f"the queue is full ({scheduler.max_queue} requests waiting); retry later")
        except Draining:
            return error(503, "the server is shutting down")
        rid = responses.new_id(chat)

        def cancel() -> None:
            for r in job.choices:
                r.cancelled = True

        async def finished() -> bool:
            """Waits for every choice's last token; False (requests cancelled) if the client goes away first."""
            checked, left = time.monotonic(), len(job.choices)
            while left:
                try:
                    k, _, _, done = await asyncio.wait_for(events.get(), timeout=DISCONNECT_CHECK_S)
                    if done:
                        if not job.choices[k].error:
                            metrics.request_done(job.choices[k])
                        left -= 1
                    continue
                except TimeoutError:
                    pass
                if time.monotonic() - checked >= DISCONNECT_CHECK_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        cancel()
                        return False
            return True

        if not job.stream:
            if not await finished():
                return error(499, "client closed the request")
            if any(r.error for r in job.choices):
                return error(503, next(r.error for r in job.choices if r.error))
            return responses.response(job, rid, model_name, tokenizer)

        async def sse():
            seen, offsets, left = [0] * len(job.choices), [0] * len(job.choices), len(job.choices)
            try:
                while left:
                    k, token, delta, done = await events.get()
                    if job.choices[k].error:  # headers are out: the error goes as the stream's last event
                        yield f"data: {json.dumps({'error': {'message': job.choices[k].error, 'code': 503}})}\n\n"
                        return
                    out = responses.chunk(job, rid, model_name, k, token, delta, done, seen[k], offsets[k], tokenizer)
                    if token is not None:
                        seen[k] += 1
                        offsets[k] += len(responses.token_text(tokenizer, token))
                    if done:
                        metrics.request_done(job.choices[k])
                        left -= 1
                    yield f"data: {json.dumps(out)}\n\n"
            finally:
                if left:  # the client went away: free the slots
                    cancel()
            if job.include_usage:
                usage = {"id": rid, "object": "usage", "choices": [], "usage": responses.usage(job)}
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.get("/version")
    async def version():
        return {"version": moejax_version()}

    @app.post("/tokenize")
    async def tokenize(request: HTTPRequest):
        try:
            return openai.tokenize(openai.load_body(await request.body()), tokenizer, scheduler.max_len)
        except UsageError as e:
            return error(400, str(e))

    @app.post("/detokenize")
    async def detokenize(request: HTTPRequest):
        try:
            return openai.detokenize(openai.load_body(await request.body()), tokenizer, scheduler.engine.c.vocab_size)
        except UsageError as e:
            return error(400, str(e))

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await complete(request, chat=True)

    return app


def serve(app, host: str, port: int) -> None:
    import uvicorn

    print(f"moejax serve: listening on http://{host}:{port}", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal it shut down on once it has restored the handler it found: a
    # no-op one lets the caller finish (stop the followers, leave jax.distributed) and exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    # timeout_graceful_shutdown None: on SIGTERM wait for every running request, however long.
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=None)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
