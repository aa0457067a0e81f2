"""The bare ASGI the gateway's modules share: the callables' types, request headers, a whole
response in one go.

The gateway answers on the hot path without a framework, so these few lines stand in for one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

ASGIReceive = Callable[[], Awaitable[dict[str, Any]]]
ASGISend = Callable[[dict[str, Any]], Awaitable[None]]

JSON_HEADER = (b"content-type", b"application/json")


def request_headers(scope: dict[str, Any]) -> dict[str, str]:
    """The request's headers by lower-case name (ASGI servers send them lower-cased)."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


async def send_bytes(
    send: ASGISend, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Send a whole response: ``status``, ``headers`` (default: JSON) and ``body``."""
    hdrs = [*(headers or [JSON_HEADER]), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})
