"""What ``voltrl serve`` and ``voltrl gateway`` run: the store server and the gateway, composed
into one ASGI app or served apart, with bearer-token auth and a clean shutdown on a signal.

``voltrl serve`` serves a store (SQLite file, PostgreSQL, memory) under ``/v1/store`` and, when
backends are given, the gateway beside it (``/v1/chat/completions``, ``/rollouts/.../v1/...``)
in the same process. ``voltrl gateway`` serves only the gateway, recording into a store server
elsewhere. Both bind 127.0.0.1 unless told otherwise; binding any other address requires a
token, and with a token every route but the health check requires ``Authorization: Bearer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import signal
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from voltrl.errors import VoltRLError
from voltrl.gateway import Gateway
from voltrl.store.base import Store
from voltrl.store.client import API_PREFIX, ErrorDetail, ErrorResponse
from voltrl.store.routing import bearer_matches

HEALTH_PATH = f"{API_PREFIX}/health"
"""The one route that never needs a token."""

DEFAULT_PORT = 8400
"""Port of ``voltrl serve`` and ``voltrl gateway`` unless ``--port`` says otherwise."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``127.0.0.1``, ``::1``, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def require_token_off_loopback(host: str, token: str | None) -> None:
    """Raise :class:`VoltRLError` if ``host`` is not loopback and there is no token."""
    if not token and not is_loopback(host):
        raise VoltRLError(
            f"binding {host} exposes the server beyond this machine: pass --token or set "
            "VOLTRL_TOKEN (or bind 127.0.0.1)"
        )


class BearerAuth:
    """ASGI middleware: every HTTP request but the health check needs ``Bearer <token>``.

    Refusals are 401 with the store's JSON error body, whichever app is behind.
    """

    def __init__(self, app: ASGIApp, token: str, open_paths: Sequence[str] = (HEALTH_PATH,)):
        if not token:
            raise ValueError("BearerAuth needs a non-empty token")
        self.app = app
        self._expected = token.encode()
        self._open = frozenset(open_paths)
        self._refusal = (
            ErrorResponse(
                error=ErrorDetail(type="Unauthorized", message="missing or wrong bearer token")
            )
            .model_dump_json()
            .encode()
        )

    def _allowed(self, scope: Scope) -> bool:
        if scope["path"] in self._open:
            return True
        for name, value in scope["headers"]:
            if name == b"authorization":
                return bearer_matches(value, self._expected)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(self._refusal)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": self._refusal})


def server_app(
    store: Store,
    *,
    token: str | None = None,
    gateway: Gateway | None = None,
    max_wait_s: float | None = None,
) -> ASGIApp:
    """The app of ``voltrl serve``: the store API under ``/v1/store`` (its OpenAPI spec at
    ``/openapi.json``, docs at ``/docs``) and, when given, the gateway on every other path.

    With a ``token`` every route but ``/v1/store/health`` requires it. ``max_wait_s`` caps
    long-poll requests (the store server's default when None).
    """
    from voltrl.store.server import store_app

    options: dict[str, Any] = {} if max_wait_s is None else {"max_wait_s": max_wait_s}
    app = store_app(store, **options)
    app.title = "VoltRL store server"
    app.add_exception_handler(Exception, _internal_error)
    if gateway is not None:
        app.mount("/", gateway.app)
    return BearerAuth(app, token) if token else app


async def _internal_error(request: Request, exc: Exception) -> Response:
    """Anything unexpected, the gateway's included, answers 500 as JSON (logged here)."""
    from voltrl.store.server import error_response

    return error_response(exc)


async def _wait_for_signal() -> None:
    """Return on SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


@contextlib.asynccontextmanager
async def _served(app: ASGIApp, host: str, port: int, graceful_s: float) -> AsyncIterator[str]:
    from voltrl.server import serve

    try:
        url, stop = await serve(app, host, port, graceful_s=graceful_s)
    except OSError as exc:
        raise VoltRLError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        yield url
    finally:
        await stop()


def make_gateway(
    store: Store, backends: Sequence[str], token: str | None, options: dict[str, Any]
) -> Gateway:
    """A gateway recording into ``store`` for a server guarded by ``token`` (``options``:
    :class:`~voltrl.gateway.Gateway` arguments). With a token, clients send it as their API
    key, so it is never forwarded: backends get ``backend_api_key`` (default ``EMPTY``)."""
    if token and options.get("backend_api_key") is None:
        options = {**options, "backend_api_key": "EMPTY"}
    return Gateway(store, backends, **options)


async def run_server(
    store_spec: str,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str | None = None,
    backends: Sequence[str] = (),
    gateway: bool = True,
    gateway_options: dict[str, Any] | None = None,
    graceful_s: float = 5.0,
) -> None:
    """``voltrl serve``: serve the store named by ``store_spec`` (and the gateway in front of
    ``backends``, unless ``gateway`` is False) until SIGTERM or SIGINT.

    Prints the URLs once the server accepts requests. On the signal, requests in flight get
    ``graceful_s`` seconds, then the gateway's pending writes finish and the store closes.
    """
    from voltrl.store import open_store
    from voltrl.store.sql import SQLStore

    require_token_off_loopback(host, token)
    store = open_store(store_spec)
    if isinstance(store, SQLStore):  # used from this loop only: concurrent writes commit together
        store.group_commits()
    gw = (
        make_gateway(store, backends, token, gateway_options or {})
        if gateway and backends
        else None
    )
    try:
        app = server_app(store, token=token, gateway=gw)
        async with _served(app, host, port, graceful_s) as url:
            print(f"voltrl store: {url}{API_PREFIX} ({_describe(store_spec)})", flush=True)
            if gw is not None:
                print(f"voltrl gateway: {url}/v1 -> {', '.join(gw.backends)}", flush=True)
            print(f"API docs: {url}/docs; auth: {'bearer token' if token else 'none'}", flush=True)
            await _wait_for_signal()
    finally:
        if gw is not None:
            await gw.aclose()
        await store.close()


async def run_gateway(
    store_url: str,
    backends: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str | None = None,
    gateway_options: dict[str, Any] | None = None,
    graceful_s: float = 5.0,
) -> None:
    """``voltrl gateway``: serve only the gateway, recording into the store server at
    ``store_url`` (reached with ``token``, which also guards the gateway), until a signal."""
    from voltrl.store.client import HTTPStore

    require_token_off_loopback(host, token)
    if not backends:
        raise VoltRLError("the gateway needs at least one --backend URL")
    await _check_store_server(store_url, token)
    store = HTTPStore(store_url, token=token)
    gw = make_gateway(store, backends, token, gateway_options or {})
    try:
        app: ASGIApp = BearerAuth(gw.app, token, open_paths=()) if token else gw.app
        async with _served(app, host, port, graceful_s) as url:
            print(f"voltrl gateway: {url}/v1 -> {', '.join(gw.backends)}", flush=True)
            print(f"recording into {store_url}", flush=True)
            await _wait_for_signal()
    finally:
        await gw.aclose()
        await store.close()


async def _check_store_server(url: str, token: str | None) -> None:
    """Raise :class:`VoltRLError` unless the store server at ``url`` answers an authenticated
    request (one try: a clear error now rather than retries)."""
    from voltrl.store.client import HTTPStore

    store = HTTPStore(url, token=token, retries=0)
    try:
        await store.get_resources()
    except VoltRLError as exc:
        raise VoltRLError(f"cannot use the store: {exc}") from None
    finally:
        await store.close()


def _describe(store_spec: str) -> str:
    """A store spec fit to print: a database URL loses its user and password."""
    scheme, sep, rest = store_spec.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}" if sep else store_spec
