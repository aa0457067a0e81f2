"""Dashboard sign-in sessions: a signed, expiring cookie that proves the token was given.

A session cookie is ``EXPIRES.NONCE.MAC``: when it ends (milliseconds since the epoch), a random
nonce, and an HMAC-SHA256 of both under a key derived from the token. The token itself never
sits in a cookie (a cookie that leaks, through a shared browser profile or a backup, leaks at
most a session that ends), and a server started with another token refuses every session made
under the old one. Signing out ends the session here too: its nonce is refused until it
would have expired (in memory; a restarted server forgets, and the expiry still holds).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

SESSION_COOKIE = "voltrl_session"
DEFAULT_SESSION_S = 12 * 3600.0
"""How long a sign-in lasts unless the dashboard is told otherwise."""

_KEY_LABEL = b"voltrl dashboard session"


class Sessions:
    """Makes and checks the session cookies of a dashboard guarded by ``token``; each lasts
    ``lifetime_s`` seconds."""

    def __init__(self, token: str, lifetime_s: float = DEFAULT_SESSION_S) -> None:
        if not token or lifetime_s <= 0:
            raise ValueError("sessions need a token and a positive lifetime")
        self.lifetime_s = lifetime_s
        self._key = hmac.new(token.encode(), _KEY_LABEL, hashlib.sha256).digest()
        self._ended: dict[str, int] = {}  # nonce of a signed-out session -> its expiry (ms)

    def _mac(self, payload: str) -> bytes:
        return hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest().encode()

    def start(self) -> str:
        """A new session's cookie value."""
        expires = int((time.time() + self.lifetime_s) * 1000)
        payload = f"{expires}.{secrets.token_urlsafe(16)}"
        return f"{payload}.{self._mac(payload).decode()}"

    def _parse(self, cookie: str) -> tuple[str, int] | None:
        """The nonce and expiry of a cookie signed here that has not expired, else None."""
        expires, _, rest = cookie.partition(".")
        nonce, _, mac = rest.partition(".")
        if not (expires.isascii() and expires.isdigit()) or not hmac.compare_digest(
            mac.encode(), self._mac(f"{expires}.{nonce}")
        ):
            return None
        if int(expires) <= time.time() * 1000:
            return None
        return nonce, int(expires)

    def valid(self, cookie: str) -> bool:
        """Whether ``cookie`` is a session of this token that has neither expired nor ended."""
        parsed = self._parse(cookie)
        return parsed is not None and parsed[0] not in self._ended

    def end(self, cookie: str) -> None:
        """Sign ``cookie``'s session out: it is refused from now on."""
        parsed = self._parse(cookie)
        if parsed is None:
            return
        now = time.time() * 1000
        self._ended = {n: e for n, e in self._ended.items() if e > now}  # the expired need no entry
        self._ended[parsed[0]] = parsed[1]
