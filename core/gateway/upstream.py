"""The upstream side: which backend replica a call goes to, and sending it there with retries.

Replicas are sticky per rollout (its calls share the replica's prefix cache) and a new rollout
goes to the least loaded one; a retry moves the rollout to another replica when there is one.
:func:`backend_body` is what the gateway asks of the backend on the client's behalf: token ids
(vLLM's ``return_token_ids``), logprobs, and the usage of a stream.
"""

from __future__ import annotations

import logging
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp

from voltrl._http import CLIENT_KEEPALIVE_S
from voltrl.gateway.errors import GatewayHTTPError, backend_error
from voltrl.gateway.records import Call
from voltrl.retry import RETRY_STATUSES, Backoff, Retry

logger = logging.getLogger(__name__)

_PIN_LIMIT = 100_000  # rollouts remembered for sticky routing


class Upstream:
    """The backend replicas, a pooled client to them, and the retries of each request.

    Args:
        backends: OpenAI base URLs of the replicas (``http://host:port/v1``).
        backoff: retries after a backend 408/429/5xx, connection error or timeout, and the
            waits between them.
        timeout_s: longest a backend may stay silent while answering one try.
        connect_timeout_s: longest a connection to a backend may take.
        api_key: sent as the bearer token to backends; when None the client's
            ``Authorization`` header is forwarded.
        max_connections: pooled connections to all backends together.
        extra_headers: sent to backends with every request (a provider's own key header,
            such as Azure OpenAI's ``api-key``).
    """

    def __init__(
        self,
        backends: Sequence[str],
        backoff: Backoff,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        api_key: str | None,
        max_connections: int,
        extra_headers: Mapping[str, str] | None = None,
    ) -> None:
        self.backends = [b.rstrip("/") for b in backends]
        self.extra_headers = {k.lower(): v for k, v in (extra_headers or {}).items()}
        self.backoff = backoff
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.api_key = api_key
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._pins: OrderedDict[str, int] = OrderedDict()
        self._pinned = [0] * len(self.backends)
        self._load = [0] * len(self.backends)

    def pick(self, rollout_id: str, avoid: int | None = None) -> int:
        """The rollout's pinned replica; new rollouts (and ones moved off a failing replica)
        go to the least loaded one, ties broken by fewest pinned rollouts, then by hash."""
        idx = self._pins.get(rollout_id)
        if idx is not None and idx != avoid:
            return idx
        n = len(self.backends)
        h = zlib.crc32(rollout_id.encode())
        order = [(h + k) % n for k in range(n)]
        candidates = [i for i in order if i != avoid] or order
        best = min(candidates, key=lambda i: (self._load[i], self._pinned[i]))
        if idx is not None:
            self._pinned[idx] -= 1
            del self._pins[rollout_id]
        elif len(self._pins) >= _PIN_LIMIT:
            _, old = self._pins.popitem(last=False)
            self._pinned[old] -= 1
        self._pins[rollout_id] = best
        self._pinned[best] += 1
        return best

    def headers(self, client_headers: dict[str, str]) -> dict[str, str]:
        """The headers of a request to a backend: JSON, the backend key or the client's, and
        the extra headers (which win, as the OpenAI client's ``extra_headers`` do)."""
        out = {"content-type": "application/json"}
        if self.api_key is not None:
            out["authorization"] = f"Bearer {self.api_key}"
        elif "authorization" in client_headers:
            out["authorization"] = client_headers["authorization"]
        return {**out, **self.extra_headers}

    async def send(
        self, rollout_id: str | None, path: str, payload: bytes | None, headers: dict[str, str]
    ) -> tuple[int, aiohttp.ClientResponse]:
        """POST (or GET when ``payload`` is None) with retries (:attr:`backoff`), each retry
        on another replica when there is one. Returns the replica index and an open 2xx
        response, or raises :class:`GatewayHTTPError` once retries are spent."""
        session = self._client()
        idx = self.pick(rollout_id) if rollout_id is not None else 0
        tries = self.backoff.retries + 1

        def failed(status: int, problem: str, retry_after: str | None = None) -> Retry:
            message = f"backend failed after {tries} tries; last error: {problem}"
            return Retry(problem, GatewayHTTPError(status, message, type="api_error"), retry_after)

        async def attempt(tried: int) -> tuple[int, aiohttp.ClientResponse] | Retry:
            nonlocal idx
            if tried and rollout_id is not None and len(self.backends) > 1:
                idx = self.pick(rollout_id, avoid=idx)
            self._load[idx] += 1
            try:
                if payload is None:
                    resp = await session.get(self.backends[idx] + path, headers=headers)
                else:
                    resp = await session.post(
                        self.backends[idx] + path, data=payload, headers=headers
                    )
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                return failed(
                    504 if isinstance(e, TimeoutError) else 502, f"{type(e).__name__}: {e}"
                )
            finally:
                self._load[idx] -= 1
            if resp.status < 300:
                return idx, resp
            text = (await resp.read()).decode("utf-8", "replace")
            resp.release()
            if resp.status not in RETRY_STATUSES:
                raise backend_error(resp.status, text)
            problem = f"HTTP {resp.status}: {text[:500]}"
            return failed(resp.status, problem, resp.headers.get("retry-after"))

        method = "GET" if payload is None else "POST"
        return await self.backoff.run(attempt, f"gateway {method} {path}", logger)

    async def aclose(self) -> None:
        """Close the pooled connections (a later request opens new ones)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self.max_connections,
                    limit_per_host=0,
                    keepalive_timeout=CLIENT_KEEPALIVE_S,
                ),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.connect_timeout_s, sock_read=self.timeout_s
                ),
                auto_decompress=True,
            )
        return self._session


_NOT_FILLED = ("extra_headers", "extra_query", "timeout", "stream", "stream_options")
"""OpenAI client options that may sit in ``sampling_parameters`` and are no request field,
and the request's own choice of streaming."""
_SAME_CAP = {"max_tokens": "max_completion_tokens", "max_completion_tokens": "max_tokens"}


def fill_sampling(body: dict[str, Any], defaults: Mapping[str, Any]) -> None:
    """Fill the sampling fields ``body`` leaves out from ``defaults`` (in place), as the OpenAI
    client would send them: ``extra_body``'s fields as fields, its other options
    (``extra_headers``...) and streaming not at all; ``max_completion_tokens`` and
    ``max_tokens`` count as one."""
    for key, value in defaults.items():
        if key == "extra_body" and isinstance(value, Mapping):
            fill_sampling(body, value)
            continue
        if key in _NOT_FILLED:
            continue
        if key in _SAME_CAP and body.get(_SAME_CAP[key]) is not None:
            continue  # the request set its cap under the other name
        if body.get(key) is None:
            body[key] = value


def backend_body(
    call: Call,
    *,
    model: str | None,
    model_for_agent: Callable[[str | None], str | None] | None,
    request_token_ids: bool,
) -> dict[str, Any]:
    """The body forwarded for ``call``: its own, with the served model (``model``, or the
    agent's adapter from ``model_for_agent``), and the token ids, logprobs and stream usage
    the gateway records, whether or not the client asked for them."""
    body = dict(call.body)
    if model is not None:
        body["model"] = model
    if model_for_agent is not None:
        body["model"] = model_for_agent(call.agent_name) or body.get("model")
    if request_token_ids:
        body["return_token_ids"] = True
    if call.kind == "chat":
        if not call.wants_logprobs:
            body["logprobs"], body["top_logprobs"] = True, 0
    elif not call.wants_logprobs:
        body["logprobs"] = 0
    if body.get("stream") and not call.wants_usage:
        opts = body.get("stream_options")
        body["stream_options"] = {
            **(opts if isinstance(opts, dict) else {}),
            "include_usage": True,
        }
    return body
