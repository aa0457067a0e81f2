"""The routing of the store server: its route class and error answers, and the app that sends
requests for the store's routes straight to them.

The store's routes are FastAPI routes, so the OpenAPI schema describes them and
:func:`~voltrl.store.http.endpoints.store_router` mounts in any FastAPI app, but their requests
do not go through FastAPI's dependency machinery, which costs more than the store's own work:

- :func:`route_class` makes a route class whose handler checks the body size, binds the
  endpoint's path, query and body parameters from its signature (bound once; a body is parsed
  by pydantic's JSON parser in one pass), and answers every error as JSON;
- :class:`StoreApp` (what ``store_app`` builds) sends a request for one of those routes
  straight to it, past FastAPI's middleware stack and router; other paths (the OpenAPI spec,
  unknown ones) go through FastAPI.

Why not plain FastAPI (measured 2026-11-23 with ``benchmarks/run_peer_store.py``: ``voltrl
serve`` over SQLite, a token, N = 1, 8, 32 workers; the variants' runs interleaved on the same
2 cores, shared with other jobs, load average 1.4-3.8; medians of 5-11 runs each):

- plain FastAPI routes (``APIRouter``'s own route class, app exception handlers, a body-size
  middleware): server CPU per rollout 1.31/1.15/1.14 -> 1.69/1.60/1.67 ms, completed
  rollouts/s 0.88/0.79/0.80x (paired runs);
- this route class, but through FastAPI's middleware stack and router (no :class:`StoreApp`):
  server CPU per rollout 1.31/1.15/1.14 -> 1.51/1.21/1.25 ms (+15/+5/+10%); rollouts/s too
  noisy to tell apart (0.96-1.07x, run-to-run spread about 20%).

``benchmarks/store_asgi_bench.py``, which drives the app's ASGI callable in process (in-memory
store, no sockets: enqueue, claim, complete with 10 spans), gives the same picture steadily:
285 us of CPU per rollout here, 382 us without :class:`StoreApp` (+32 us per request), 502 us
with plain FastAPI. Plain FastAPI loses well over the 10% a simplification may cost; dropping
:class:`StoreApp` alone costs about 10% of the server's CPU, which bounds the rollouts/s of
many workers, so both parts stay.

:class:`~voltrl._http.auth.BearerAuth` is the one place that checks the token: ``store_app`` (so
``voltrl serve``) and every served gateway wrap their whole app in it, so it guards the store,
OTLP and gateway routes alike.

Errors are JSON ``{"error": {"type": ..., "message": ...}}``: ``NotFoundError`` 404,
``StaleAttemptError`` 409, other store errors 400, bad bodies 422, missing or wrong token 401
(:class:`~voltrl._http.auth.BearerAuth`), a body over the size limit 413, anything unexpected
500 (logged with its traceback; the answer carries only the message).
"""

from __future__ import annotations

import inspect
import logging
import typing
from collections.abc import Awaitable, Callable, Coroutine
from re import Pattern
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from voltrl.errors import NotFoundError, StaleAttemptError, VoltRLError
from voltrl.store.http.client import API_PREFIX, ErrorDetail, ErrorResponse

logger = logging.getLogger("voltrl.store.http.endpoints")

_JSON = "application/json"
_HTTP_ERROR_TYPES = {
    400: "BadRequest",
    401: "Unauthorized",
    404: "NotFound",
    405: "MethodNotAllowed",
    413: "PayloadTooLarge",
    415: "UnsupportedMediaType",
}
HEALTH_PATH = f"{API_PREFIX}/health"
"""The one route that never needs a token."""


def error_parts(exc: Exception) -> tuple[int, bytes, dict[str, str]]:
    """Status, JSON body and headers of the error answer for ``exc``."""
    headers: dict[str, str] = {}
    if isinstance(exc, NotFoundError):
        status, kind, message = 404, "NotFoundError", str(exc)
    elif isinstance(exc, StaleAttemptError):
        status, kind, message = 409, "StaleAttemptError", str(exc)
    elif isinstance(exc, RequestValidationError | ValidationError):
        problems = [
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}"
            for e in exc.errors()
        ]
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        status, kind, message = 422, "ValidationError", "; ".join(problems[:10]) + more
    elif isinstance(exc, HTTPException):
        status, message = exc.status_code, str(exc.detail)
        kind = _HTTP_ERROR_TYPES.get(status, "HTTPError")
        headers = dict(exc.headers or {})
    elif isinstance(exc, VoltRLError):
        status, kind, message = 400, type(exc).__name__, str(exc)
    else:
        logger.error("store server: unexpected error", exc_info=exc)
        status, kind = 500, "InternalError"
        message = f"unexpected {type(exc).__name__}: {exc}"
    body = ErrorResponse(error=ErrorDetail(type=kind, message=message))
    return status, body.model_dump_json().encode(), headers


def error_response(exc: Exception) -> Response:
    """The JSON error answer for ``exc`` (see the module docstring for the statuses)."""
    status, body, headers = error_parts(exc)
    return Response(body, status_code=status, media_type=_JSON, headers=headers)


async def http_exception(request: Request, exc: Exception) -> Response:
    return error_response(exc)


def _limited(receive: Receive, max_bytes: int) -> Receive:
    """``receive`` that fails with 413 once the body grows past ``max_bytes``."""
    seen = 0

    async def receive_limited() -> Message:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > max_bytes:
            raise HTTPException(413, f"request body over the limit of {max_bytes} bytes")
        return message

    return receive_limited


def _invalid(exc: ValidationError, where: tuple[str, ...]) -> RequestValidationError:
    """``exc``'s problems, located under ``where`` (``("body",)``, ``("query", "version")``)."""
    return RequestValidationError(
        [{**e, "loc": (*where, *e.get("loc", ()))} for e in exc.errors(include_url=False)]
    )


Binder = Callable[[Request], Awaitable[dict[str, Any]]]


def _binder(endpoint: Callable[..., Any], path_params: set[str]) -> Binder:
    """A function giving the arguments of ``endpoint`` for a request, from its signature: a
    ``Request`` parameter gets the request, path parameters their (string) value, one pydantic
    model parameter the JSON body, and the others the query parameter of their name."""
    hints = typing.get_type_hints(endpoint)
    request_name: str | None = None
    body: tuple[str, TypeAdapter[Any]] | None = None
    queries: dict[str, tuple[TypeAdapter[Any], Any]] = {}
    for name, param in inspect.signature(endpoint).parameters.items():
        kind = hints.get(name)
        if kind is Request:
            request_name = name
        elif name in path_params:
            continue
        elif isinstance(kind, type) and issubclass(kind, BaseModel):
            body = (name, TypeAdapter(kind))
        else:
            queries[name] = (TypeAdapter(kind), param.default)

    async def bind(request: Request) -> dict[str, Any]:
        args: dict[str, Any] = dict(request.path_params)
        if request_name is not None:
            args[request_name] = request
        for name, (adapter, default) in queries.items():
            given = request.query_params.get(name)
            try:
                args[name] = default if given is None else adapter.validate_python(given)
            except ValidationError as exc:
                raise _invalid(exc, ("query", name)) from None
        if body is not None:
            try:
                args[body[0]] = body[1].validate_json(await request.body())
            except ValidationError as exc:
                raise _invalid(exc, ("body",)) from None
        return args

    return bind


class StoreRoute(APIRoute):
    """Base of the route classes :func:`route_class` makes (one per router's settings)."""


def route_class(max_body_bytes: int) -> type[StoreRoute]:
    """A route class whose handlers check the body size, bind the endpoint's arguments
    themselves (see the module docstring) and answer every error as JSON.

    Done per route (not as middleware or app exception handlers) so the routes keep this
    behaviour when the router is included in another app.
    """

    class _Route(StoreRoute):
        def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
            super().__init__(path, endpoint, **kwargs)
            self.app = _asgi(self.get_route_handler())

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            endpoint = self.endpoint
            bind = _binder(endpoint, set(self.param_convertors))

            async def handle(request: Request) -> Response:
                try:
                    length = request.headers.get("content-length")
                    if length is not None and length.isdigit():
                        if int(length) > max_body_bytes:
                            raise HTTPException(
                                413, f"request body of {length} bytes is over the limit of "
                                f"{max_body_bytes} bytes",
                            )  # fmt: skip
                    elif request.method != "GET":
                        request = Request(request.scope, _limited(request.receive, max_body_bytes))
                    return await endpoint(**await bind(request))
                except Exception as exc:
                    return error_response(exc)

            return handle

    return _Route


def _asgi(handler: Callable[[Request], Awaitable[Response]]) -> ASGIApp:
    """A route's ASGI app: the handler's answer, without FastAPI's per-request wrappers (exit
    stacks for dependencies with ``yield``, exception handlers), which the handler needs not."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        response = await handler(Request(scope, receive, send))
        await response(scope, receive, send)

    return app


class StoreApp(FastAPI):
    """The FastAPI app of :func:`store_app`, which sends a request for one of the store's
    routes straight to that route.

    The routes check the body size and answer errors themselves, so FastAPI's middleware
    stack and router, which cost more per request than the store's own work, are skipped for
    them; anything else (the OpenAPI spec, unknown paths) goes through FastAPI.
    """

    def index_routes(self, prefix: str, router: APIRouter) -> None:
        """Send requests for ``router``'s store routes, included under ``prefix``, straight
        to them."""
        if not hasattr(self, "_static"):
            self._static: dict[tuple[str, str], StoreRoute] = {}
            self._patterns: list[tuple[str, Pattern[str], StoreRoute]] = []
        for route in router.routes:
            if not isinstance(route, StoreRoute):
                continue
            for method in route.methods:
                if route.param_convertors:
                    regex, _, _ = compile_path(prefix + route.path)
                    self._patterns.append((method, regex, route))
                else:
                    self._static[method, prefix + route.path] = route

    def _route_for(self, scope: Scope) -> StoreRoute | None:
        method, path = scope["method"], scope["path"]
        route = self._static.get((method, path))
        if route is not None:
            scope["path_params"] = {}
            return route
        for route_method, regex, route in self._patterns:
            if route_method == method and (match := regex.match(path)):
                scope["path_params"] = match.groupdict()  # every path parameter is a string
                return route
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            route = self._route_for(scope)
            if route is not None:
                scope["route"] = route
                await route.app(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
