"""Serving a gateway: the one way every gateway is served (the trainer's, LocalRL's, VERL's,
``voltrl gateway``), behind the run's token on a URL other machines can use."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp

from voltrl._http.auth import BearerAuth
from voltrl._http.serving import reachable_url, require_token_off_loopback, serve
from voltrl.errors import VoltRLError
from voltrl.gateway.proxy import Gateway
from voltrl.retry import GatewayRetry
from voltrl.store.base import Store


def make_gateway(
    store: Store,
    backends: Sequence[str],
    token: str | None,
    options: dict[str, Any],
    retry: GatewayRetry | None = None,
) -> Gateway:
    """A gateway recording into ``store`` for a server guarded by ``token`` (``options``:
    :class:`~voltrl.gateway.proxy.Gateway` arguments). With a token, clients send it as their API
    key, so it is never forwarded: backends get ``backend_api_key`` (default ``EMPTY``)."""
    if token and options.get("backend_api_key") is None:
        options = {**options, "backend_api_key": "EMPTY"}
    return Gateway(store, backends, **(retry or GatewayRetry()).model_dump(), **options)


@dataclass(frozen=True)
class ServedGateway:
    """A gateway being served: the object (pause/resume) and the base URL agents use
    (``http://host:port/v1``)."""

    gateway: Gateway
    url: str
    stop: Callable[[], Awaitable[None]]


async def start_gateway(
    store: Store,
    backends: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    retry: GatewayRetry | None = None,
    graceful_s: float = 2.0,
    **options: Any,
) -> ServedGateway:
    """Serve a gateway in front of ``backends`` on the running loop: the one way every gateway
    is served (the trainer's, LocalRL's, VERL's, ``voltrl gateway``).

    It binds ``host`` (off loopback only with a ``token``, else :class:`VoltRLError`), checks
    ``token`` on every request, and returns a URL other machines can use (a wildcard host is
    replaced by this machine's name). ``options`` are :class:`~voltrl.gateway.proxy.Gateway`
    arguments. ``stop`` gives calls in flight ``graceful_s`` to finish and answers the rest
    503, then stops the server and the gateway (its pending writes finish).
    """
    require_token_off_loopback(host, token)
    gateway = make_gateway(store, backends, token, options, retry)
    app: ASGIApp = BearerAuth(gateway.app, token, open_paths=()) if token else gateway.app
    try:
        url, stop_server = await serve(app, host, port, graceful_s=graceful_s)
    except (OSError, RuntimeError) as exc:
        await gateway.aclose()
        raise VoltRLError(f"cannot serve a gateway on {host}:{port}: {exc}") from None

    async def stop() -> None:
        try:
            await gateway.stop_calls(graceful_s)  # the server then finds none to cancel
            await stop_server()
        finally:
            await gateway.aclose()

    return ServedGateway(gateway, f"{reachable_url(url)}/v1", stop)
