"""Bearer-token auth: the one check of the token in front of every server of VoltRL."""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send


class BearerAuth:
    """ASGI middleware: every HTTP request but those for ``open_paths`` (and paths under
    ``open_prefixes``, whose app checks the token itself) needs
    ``Authorization: Bearer <token>`` (compared in constant time).

    Refusals are 401 with the store's JSON error body (``{"error": {"type", "message"}}``),
    whichever app is behind.
    """

    def __init__(
        self,
        app: ASGIApp,
        token: str,
        open_paths: Sequence[str] = (),
        open_prefixes: Sequence[str] = (),
    ):
        if not token:
            raise ValueError("BearerAuth needs a non-empty token")
        self.app = app
        self._expected = token.encode()
        self._open = frozenset(open_paths)
        self._open_prefixes = tuple(open_prefixes)
        refusal = {"error": {"type": "Unauthorized", "message": "missing or wrong bearer token"}}
        self._refusal = json.dumps(refusal).encode()

    def _allowed(self, scope: Scope) -> bool:
        if scope["path"] in self._open or scope["path"].startswith(self._open_prefixes):
            return True
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, given = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    given.strip(), self._expected
                )
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
