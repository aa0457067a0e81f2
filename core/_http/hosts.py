"""The Host check of servers on loopback: only requests addressed to this machine get in.

A server bound to a loopback address is out of other machines' reach, but not out of a web
page's: a page on ``attacker.example`` whose name the attacker then points at ``127.0.0.1``
(DNS rebinding) makes the browser send its requests to the local server, with
``Host: attacker.example``, and read the answers as the page's own origin. Without a token the
store, the dashboard, a gateway or ``voltrl model serve`` would answer it. A browser always sends
the name it resolved, so answering only loopback names (``localhost``, ``127.x.x.x``,
``[::1]``, any port) shuts that door; clients on this machine use those names anyway.
"""

from __future__ import annotations

import ipaddress
import json

from starlette.types import ASGIApp, Receive, Scope, Send

MISDIRECTED = 421
"""The status of a refused request: "misdirected", this server does not serve that name."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``127.0.0.1``, ``::1``, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a ``Host`` header, without its port, brackets or final dot, in lower case
    (``[::1]:8400`` is ``::1``, ``LocalHost.:80`` is ``localhost``)."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 address, whose colons are not a port's
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0].rstrip(".") if ":" in header else header.rstrip(".")


class HostCheck:
    """ASGI middleware: answers HTTP and WebSocket requests only when their ``Host`` is a
    loopback name; others get 421 with a JSON error body (in the store's format). A request
    without a ``Host`` header passes: browsers always send one.

    :func:`voltrl._http.serving.serve` puts it around every app it serves on a loopback address
    (whose own name, the address it binds, is a loopback name too).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        message = "this server answers only requests for this machine (localhost, 127.x, [::1])"
        refusal = {"error": {"type": "MisdirectedRequest", "message": message}}
        self._refusal = json.dumps(refusal).encode()

    def _allowed(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"host":
                return is_loopback(host_name(value.decode("latin-1")))
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # before accept: a 403
        else:
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(self._refusal)).encode()),
            ]
            await send({"type": "http.response.start", "status": MISDIRECTED, "headers": headers})
            await send({"type": "http.response.body", "body": self._refusal})
