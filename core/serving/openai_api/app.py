"""The OpenAI-compatible web app of a LocalRL :class:`~..engine.Engine`, served on a port.

:func:`create_app` routes ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` and
``/health`` to :class:`~.handlers.Handlers`; a request whose client disconnects is cancelled.
:func:`serve_engine` and :func:`serve_engine_in_thread` run the app on a local port.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp

from voltrl._http.serving import BackgroundServer, serve, serve_in_thread
from voltrl.models.toolcalls import DEFAULT_TOOL_PARSER, checked_tool_parser
from voltrl.serving.engine import Engine, EngineError
from voltrl.serving.openai_api.handlers import Handlers, LogprobsMode, error_body
from voltrl.serving.openai_api.params import BadRequest


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """What ``work`` returns, unless the client disconnects first: then ``work`` is cancelled
    (its sequences leave the engine's batch) and the answer is a 499 nobody reads."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # a no-op once it is done
    return task.result() if task in done else Response(status_code=499)


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (call it once the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(
    engine: Engine,
    *,
    model_name: str = "voltrl-local",
    logprobs_mode: LogprobsMode = "raw",
    default_max_tokens: int | None = None,
    tool_parser: str = DEFAULT_TOOL_PARSER,
) -> FastAPI:
    """The OpenAI-compatible FastAPI app serving ``engine`` (started here) as ``model_name``.
    ``default_max_tokens`` caps a chat reply whose request sets no ``max_tokens`` (None: up
    to the context; a completion's default stays OpenAI's 16). ``tool_parser``: the format
    the model writes tool calls in (:data:`voltrl.models.toolcalls.TOOL_PARSER_CHOICES`; a
    ``ValueError`` names them).

    Mount it or run it with :func:`serve_engine` / :func:`serve_engine_in_thread`; closing the
    engine stays the caller's job.
    """
    if logprobs_mode not in ("raw", "processed"):
        raise ValueError(f"logprobs_mode must be 'raw' or 'processed', not {logprobs_mode!r}")
    checked_tool_parser(tool_parser)  # before the engine starts
    engine.start()
    server = Handlers(engine, model_name, logprobs_mode, tool_parser)
    app = FastAPI(title="VoltRL local engine", docs_url=None, redoc_url=None)
    app.state.engine_server = server

    async def handle(request: Request, fn: Callable[[dict[str, Any]], Awaitable[Any]]) -> Any:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            return JSONResponse(
                error_body(f"invalid JSON body: {e}", "invalid_request_error", 400), 400
            )
        if not isinstance(body, dict):
            return JSONResponse(
                error_body("the body must be a JSON object", "invalid_request_error", 400), 400
            )
        try:
            return await _unless_disconnected(request, fn(body))
        except BadRequest as e:
            return JSONResponse(error_body(e.message, "invalid_request_error", 400, e.param), 400)
        except EngineError as e:
            return JSONResponse(error_body(str(e), "api_error", 503), 503)

    async def chat_with_default(body: dict[str, Any]) -> Any:
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = default_max_tokens
        return await server.chat(body)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await handle(
            request, server.chat if default_max_tokens is None else chat_with_default
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, server.completions)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.running
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, 200 if ok else 503)

    return app


async def serve_engine(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    model_name: str = "voltrl-local",
    logprobs_mode: LogprobsMode = "raw",
    log_level: str = "warning",
    token: str | None = None,
    default_max_tokens: int | None = None,
    tool_parser: str = DEFAULT_TOOL_PARSER,
) -> tuple[str, Callable[[], Awaitable[None]]]:
    """Serve ``engine`` on the running event loop (``port=0``: a free port).

    With a ``token`` every route but ``/health`` requires ``Authorization: Bearer <token>``
    (clients pass it as their API key). Returns the server's base URL (the OpenAI base URL is
    that plus ``/v1``) and an async ``stop``; see :func:`voltrl._http.serving.serve`.
    ``default_max_tokens``, ``tool_parser``: see :func:`create_app`.
    """
    app: ASGIApp = create_app(
        engine,
        model_name=model_name,
        logprobs_mode=logprobs_mode,
        default_max_tokens=default_max_tokens,
        tool_parser=tool_parser,
    )
    if token:
        from voltrl._http.auth import BearerAuth

        app = BearerAuth(app, token, open_paths=("/health",))
    return await serve(app, host, port, log_level=log_level)


def serve_engine_in_thread(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    model_name: str = "voltrl-local",
    logprobs_mode: LogprobsMode = "raw",
    log_level: str = "warning",
    tool_parser: str = DEFAULT_TOOL_PARSER,
) -> BackgroundServer:
    """Serve ``engine`` from a background thread (:func:`voltrl._http.serving.serve_in_thread`)."""
    app = create_app(
        engine, model_name=model_name, logprobs_mode=logprobs_mode, tool_parser=tool_parser
    )
    return serve_in_thread(app, host, port, log_level=log_level)
