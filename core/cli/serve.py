"""``voltrl serve`` and ``voltrl gateway``: the store server and the gateway, composed into one
ASGI app or served apart, with bearer-token auth and a clean shutdown on a signal.

``voltrl serve`` serves a store (SQLite file, PostgreSQL, memory) under ``/v1/store`` and, when
backends are given, the gateway beside it (``/v1/chat/completions``, ``/rollouts/.../v1/...``)
in the same process. ``voltrl gateway`` serves only the gateway, recording into a store server
elsewhere. Both bind 127.0.0.1 unless told otherwise; binding any other address requires a
token, and with a token every route but the health check requires ``Authorization: Bearer``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp

from voltrl._http.serving import (
    check_bindable,
    require_token_off_loopback,
    served,
    wait_for_signal,
)
from voltrl.cli.options import add_token_args, bearer_token
from voltrl.errors import VoltRLError
from voltrl.gateway import Gateway, start_gateway
from voltrl.gateway.hosting import make_gateway
from voltrl.retry import GatewayRetry
from voltrl.store.base import Store
from voltrl.store.http.client import API_PREFIX

if TYPE_CHECKING:
    from voltrl.cli.options import Subparsers

DEFAULT_PORT = 8400
"""Port of ``voltrl serve`` and ``voltrl gateway`` unless ``--port`` says otherwise."""


def server_app(
    store: Store,
    *,
    token: str | None = None,
    gateway: Gateway | None = None,
    max_wait_s: float | None = None,
    dashboard: bool | str = True,
) -> ASGIApp:
    """The app of ``voltrl serve``: the store API under ``/v1/store`` (its OpenAPI spec at
    ``/openapi.json``), the dashboard under ``/ui`` (unless ``dashboard`` is False) and, when
    given, the gateway on every other path.

    With a ``token`` every route but ``/v1/store/health`` requires it (:class:`BearerAuth`
    around the whole app). ``max_wait_s`` caps long-poll requests (the store server's default
    when None). Anything unexpected, in the gateway too, answers 500 as JSON. ``dashboard``:
    the dashboard under ``/ui`` reads the served store (True), the store at this spec with a
    connection of its own (``voltrl serve`` passes its SQLite file: pages are read on a thread,
    never holding up the runners' requests), or is left out (False).
    """
    from voltrl.observability.dashboard import Catalog, dashboard_app
    from voltrl.store.http.endpoints import store_app

    options: dict[str, Any] = {} if max_wait_s is None else {"max_wait_s": max_wait_s}
    root = None if gateway is None else gateway.app
    source = store if dashboard is True else dashboard
    ui = dashboard_app(Catalog([source]), token=token) if dashboard else None
    return store_app(store, token=token, root=root, ui=ui, **options)


async def run_server(
    store_spec: str,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str | None = None,
    backends: Sequence[str] = (),
    gateway: bool = True,
    gateway_options: dict[str, Any] | None = None,
    retry: GatewayRetry | None = None,
    graceful_s: float = 5.0,
) -> None:
    """``voltrl serve``: serve the store named by ``store_spec`` (and the gateway in front of
    ``backends``, unless ``gateway`` is False) until SIGTERM or SIGINT.

    Prints the URLs once the server accepts requests. On the signal, requests in flight get
    ``graceful_s`` seconds, then the gateway's pending writes finish and the store closes.
    """
    from voltrl.store import open_store, parse_store
    from voltrl.store.sql import SQLStore

    require_token_off_loopback(host, token)
    check_bindable(host, port)  # a port in use fails here, before a new SQLite file is made
    store = open_store(store_spec)
    if isinstance(store, SQLStore):  # used from this loop only: concurrent writes commit together
        store.group_commits()
    gw = (
        make_gateway(store, backends, token, gateway_options or {}, retry)
        if gateway and backends
        else None
    )
    try:
        ui = store_spec if isinstance(store, SQLStore) and store.path is not None else True
        app = server_app(store, token=token, gateway=gw, dashboard=ui)
        async with served(app, host, port, graceful_s) as url:
            where = parse_store(store_spec).describe()
            print(f"voltrl store: {url}{API_PREFIX} ({where})", flush=True)
            if gw is not None:
                print(f"voltrl gateway: {url}/v1 -> {', '.join(gw.backends)}", flush=True)
            auth = "bearer token" if token else "none"
            print(f"OpenAPI spec: {url}/openapi.json; auth: {auth}", flush=True)
            print(f"dashboard: {url}/ui/", flush=True)
            await wait_for_signal()
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
    retry: GatewayRetry | None = None,
    graceful_s: float = 5.0,
) -> None:
    """``voltrl gateway``: serve only the gateway, recording into the store server at
    ``store_url`` (reached with ``token``, which also guards the gateway), until a signal."""
    from voltrl.store.http import HTTPStore

    require_token_off_loopback(host, token)
    if not backends:
        raise VoltRLError("the gateway needs at least one --backend URL")
    check_bindable(host, port)
    await _check_store_server(store_url, token)
    store = HTTPStore(store_url, token=token)
    try:
        served = await start_gateway(
            store,
            backends,
            host=host,
            port=port,
            token=token,
            retry=retry,
            graceful_s=graceful_s,
            **(gateway_options or {}),
        )
        try:
            print(
                f"voltrl gateway: {served.url} -> {', '.join(served.gateway.backends)}", flush=True
            )
            print(f"recording into {store_url}", flush=True)
            await wait_for_signal()
        finally:
            await served.stop()
    finally:
        await store.close()


async def _check_store_server(url: str, token: str | None) -> None:
    """Raise :class:`VoltRLError` unless the store server at ``url`` answers an authenticated
    request (one try: a clear error now rather than retries)."""
    from voltrl.store.http import HTTPStore

    store = HTTPStore(url, token=token, retries=0)
    try:
        await store.get_resources()
    except VoltRLError as exc:
        raise VoltRLError(f"cannot use the store: {exc}") from None
    finally:
        await store.close()


# ---- the commands ------------------------------------------------------------------------
def register(sub: Subparsers) -> None:
    """Add ``voltrl serve`` and ``voltrl gateway`` to the ``voltrl`` parser."""
    serve = sub.add_parser("serve", help="serve a store (and a gateway) over HTTP")
    serve.add_argument(
        "--store", default="runs/store.sqlite", help="a SQLite path, sqlite:///, postgresql://"
    )
    serve.add_argument(
        "--backend", action="append", default=[], help="inference backend URL (…/v1); repeatable"
    )
    serve.add_argument("--no-gateway", action="store_true", help="serve the store only")
    _add_serving_args(serve)
    serve.set_defaults(func=_serve_command)

    gateway = sub.add_parser("gateway", help="serve a gateway recording into a store server")
    gateway.add_argument("--store", required=True, help="store server URL (http://HOST:PORT)")
    gateway.add_argument(
        "--backend", action="append", required=True, help="inference backend URL; repeatable"
    )
    _add_serving_args(gateway)
    gateway.set_defaults(func=_gateway_command)


def _serve_command(args: argparse.Namespace) -> int:
    from voltrl._http.serving import run

    coro = run_server(
        args.store,
        host=args.host,
        port=args.port,
        token=bearer_token(args),
        backends=args.backend,
        gateway=not args.no_gateway,
        gateway_options=_gateway_options(args),
        retry=_gateway_retry(args),
    )
    run(coro)  # on uvloop when installed
    return 0


def _gateway_command(args: argparse.Namespace) -> int:
    from voltrl._http.serving import run

    coro = run_gateway(
        args.store,
        args.backend,
        host=args.host,
        port=args.port,
        token=bearer_token(args),
        gateway_options=_gateway_options(args),
        retry=_gateway_retry(args),
    )
    run(coro)  # on uvloop when installed
    return 0


def _gateway_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Gateway arguments the command line gives (model, backend key, adapters...)."""
    options = {
        "model": args.model,
        "backend_api_key": args.backend_api_key,
        "request_token_ids": not args.no_token_ids,
        "reasoning_split": args.reasoning_split,
    }
    if args.lora_adapter:
        from voltrl.models.lora import LoraAdapters

        pairs = [a.partition("=") for a in args.lora_adapter]
        if any(not sep for _, sep, _ in pairs):
            raise VoltRLError("--lora-adapter takes NAME=REGEX (e.g. writer='write|rewrite')")
        names = [name for name, _, _ in pairs]
        if len(set(names)) < len(names):
            raise VoltRLError(f"--lora-adapter: an adapter is given twice ({', '.join(names)})")
        try:
            routes = LoraAdapters.parse(
                {name: regex for name, _, regex in pairs}, served_name=args.model or ""
            )
        except ValueError as exc:
            raise VoltRLError(f"--lora-adapter: {exc}") from None
        options["model_for_agent"] = routes.adapter_for
    return options


def _gateway_retry(args: argparse.Namespace) -> GatewayRetry:
    """The gateway's retry settings from the command line (a bad one is a usage error)."""
    from pydantic import ValidationError

    try:
        return GatewayRetry(
            retries=args.retries,
            backoff_s=args.backoff,
            max_backoff_s=args.max_backoff,
            timeout_s=args.backend_timeout,
            connect_timeout_s=args.connect_timeout,
        )
    except ValidationError as exc:
        raise VoltRLError(f"bad retry settings: {exc}") from None


def _add_serving_args(parser: argparse.ArgumentParser) -> None:
    """The options ``voltrl serve`` and ``voltrl gateway`` share: where to listen, the token,
    and the gateway's."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    add_token_args(parser)
    parser.add_argument("--model", default=None, help="gateway: force this model name")
    parser.add_argument("--backend-api-key", default=None, help="gateway: key for the backends")
    parser.add_argument(
        "--no-token-ids", action="store_true", help="gateway: do not ask backends for token ids"
    )
    parser.add_argument(
        "--lora-adapter",
        action="append",
        metavar="NAME=REGEX",
        help="gateway: send the calls of agents REGEX fully matches to the LoRA adapter NAME "
        "(as the model; first match wins; repeat for each adapter)",
    )
    parser.add_argument(
        "--reasoning-split",
        action="store_true",
        help="gateway: hand agents a model's <think>...</think> as reasoning_content",
    )
    retry = GatewayRetry()
    parser.add_argument(
        "--retries", type=int, default=retry.retries, help="gateway: extra tries per call"
    )
    parser.add_argument(
        "--backoff", type=float, default=retry.backoff_s, help="gateway: first backoff, s"
    )
    parser.add_argument(
        "--max-backoff", type=float, default=retry.max_backoff_s, help="gateway: longest backoff"
    )
    parser.add_argument(
        "--backend-timeout",
        type=float,
        default=retry.timeout_s,
        help="gateway: longest a backend may stay silent in one try, s",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=retry.connect_timeout_s,
        help="gateway: longest a backend connection may take, s",
    )
