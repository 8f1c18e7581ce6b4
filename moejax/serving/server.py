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
import json
import os
import sys
import threading
import time
import traceback

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from moejax.errors import UsageError
from moejax.serving import openai
from moejax.serving.scheduler import Draining, QueueFull

DISCONNECT_CHECK_S = 1.0  # how often a waiting non-streamed request checks that its client is still there


def error(status: int, message: str) -> JSONResponse:
    """One line of JSON, the shape OpenAI clients parse."""
    kinds = {400: "invalid_request_error", 401: "authentication_error", 429: "rate_limit_error"}
    return JSONResponse({"error": {"message": message, "type": kinds.get(status, "server_error"), "code": status}},
                        status_code=status)


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


def build_app(scheduler, metrics, *, tokenizer, eos_ids, model_name: str, api_key: str | None = None,
              on_exit=None) -> FastAPI:
    """on_exit(): called after the engine thread has finished every accepted request."""

    def engine_thread():
        try:
            scheduler.run()
        except BaseException:  # a broken engine cannot answer anything: do not leave clients hanging
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
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "moejax",
            "max_model_len": scheduler.max_len, "vocab_size": scheduler.engine.c.vocab_size,
        }]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def complete(request: HTTPRequest, chat: bool):
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return error(400, f"the request body is not valid JSON: {e}")
        try:
            if isinstance(body, dict) and body.get("model") not in (None, model_name):
                raise UsageError(f"model {body['model']!r} is not served here; this server serves {model_name!r}")
            r, stream = openai.to_request(body, tokenizer=tokenizer, eos_ids=eos_ids, chat=chat)
            loop, events = asyncio.get_running_loop(), asyncio.Queue()
            r.on_event = lambda token, delta, done: loop.call_soon_threadsafe(events.put_nowait, (token, delta, done))
            scheduler.submit(r)
        except UsageError as e:
            return error(400, str(e))
        except QueueFull:
            return error(429, f"the queue is full ({scheduler.max_queue} requests waiting); retry later")
        except Draining:
            return error(503, "the server is shutting down")
        rid = openai.new_id(chat)

        async def finished() -> bool:
            """Waits for the last token; False (request cancelled) if the client goes away first."""
            checked = time.monotonic()
            while True:
                try:
                    if (await asyncio.wait_for(events.get(), timeout=DISCONNECT_CHECK_S))[2]:
                        metrics.request_done(r)
                        return True
                except asyncio.TimeoutError:
                    pass
                if time.monotonic() - checked >= DISCONNECT_CHECK_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        r.cancelled = True
                        return False

        if not stream:
            if not await finished():
                return error(499, "client closed the request")
            return openai.response(r, rid, model_name, chat)
        include_usage = isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage")

        async def sse():
            first, done = True, False
            try:
                while not done:
                    token, delta, done = await events.get()
                    out = openai.chunk(rid, model_name, chat, token, delta, r.finish_reason if done else None, first)
                    first = False
                    yield f"data: {json.dumps(out)}\n\n"
            finally:
                r.cancelled = not done  # the client went away: free its slot
            metrics.request_done(r)
            if include_usage:
                yield f"data: {json.dumps({'id': rid, 'object': 'usage', 'choices': [], 'usage': openai.usage(r)})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

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
    # timeout_graceful_shutdown None: on SIGTERM wait for every running request, however long.
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=None)
