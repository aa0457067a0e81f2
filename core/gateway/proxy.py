"""The gateway: an OpenAI-compatible reverse proxy that records every call with its token ids.

Agents call ``/rollouts/{rollout_id}/attempts/{attempt_id}[/agents/{agent_name}]/v1/...``
(what :meth:`voltrl.resources.LLM.scoped` builds), or plain ``/v1/...`` with an
``x-rollout-id`` header (or a configurable trace header), an optional ``x-attempt-id`` (default:
the rollout's running attempt) and an optional ``x-agent-name``. The gateway forwards
``/v1/chat/completions`` and ``/v1/completions`` to a backend replica (sticky per rollout),
asks it for token ids and logprobs (vLLM's ``return_token_ids`` and ``logprobs``), stores one
:class:`~voltrl.types.LLMCall` per choice, and returns the response the client asked for: the
extra fields are removed unless the client requested them. Streaming (SSE), ``n > 1`` and tool
calls pass through. The store write is awaited before the last response bytes are sent, so
when a client's call returns, its record is in the store.

``Gateway.app`` is a plain ASGI app: run it with uvicorn, or mount it at the root of a
Starlette/FastAPI app (``app.mount("/", gateway.app)``). The hot path uses aiohttp's pooled
client and no framework routing, to keep the added latency well under a millisecond or two;
uvicorn with ``httptools`` and ``uvloop`` installed (``uvicorn[standard]``) serves it fastest.
Control calls (:meth:`Gateway.pause`, :meth:`Gateway.resume`) run on the serving event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import quote, unquote

import aiohttp

from voltrl.errors import NotFoundError
from voltrl.gateway.errors import REFUSED_SPAN, GatewayHTTPError, backend_error, refusal
from voltrl.gateway.reasoning import ReasoningSplitter, flush_deltas, split_deltas, split_messages
from voltrl.gateway.records import _Call, _calls_from_response, _StreamAccumulator, _strip
from voltrl.retry import RETRY_STATUSES, Backoff, Retry
from voltrl.store.base import Store
from voltrl.types import LLMCall, Span

logger = logging.getLogger(__name__)

ASGIReceive = Callable[[], Awaitable[dict[str, Any]]]
ASGISend = Callable[[dict[str, Any]], Awaitable[None]]

_JSON = (b"content-type", b"application/json")
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_DONE = b"data: [DONE]\n\n"
_PIN_LIMIT = 100_000  # rollouts remembered for sticky routing
_KNOWN_LIMIT = 100_000  # (rollout, attempt) pairs remembered as valid


class Gateway:
    """OpenAI-compatible recording proxy in front of one or more inference backends.

    Args:
        store: where each call is recorded (``add_llm_calls``) and rollouts are looked up.
        backends: OpenAI base URLs of the replicas, as the OpenAI client takes them
            (``http://host:port/v1``).
        model: when set, forced as the ``model`` of every forwarded request and served by
            ``/v1/models``; else the client's model is forwarded and ``/v1/models`` is proxied.
        model_for_agent: called with each call's agent name; a name it returns is forwarded as
            the call's ``model`` instead (None: as without it). How LocalRL's per-role LoRA
            adapters are served: the backend serves each adapter under its own name.
        resources_version: called at the start of each call; its value is recorded on it.
        trace_header: a header that carries the rollout id in the header form, besides
            ``x-rollout-id`` (e.g. ``trace_id``).
        max_body_bytes: larger requests are refused with 413.
        retries: extra tries after a backend 408/429/5xx, connection error or timeout.
        backoff_s, max_backoff_s: exponential backoff with jitter between tries (a backend's
            ``Retry-After`` is honoured up to ``max_backoff_s``; see :mod:`voltrl.retry`).
        timeout_s: longest a backend may stay silent while answering one try.
        connect_timeout_s: longest a connection to a backend may take.
        pause_wait_s: while paused, how long a new call waits for :meth:`resume` before it is
            answered 429 (0 answers at once).
        pause_retry_after_s: the ``Retry-After`` sent with that 429.
        request_token_ids: send vLLM's ``return_token_ids``; turn off for hosted APIs that
            reject unknown fields (calls are then recorded without token ids).
        backend_api_key: sent as the bearer token to backends; when None the client's
            ``Authorization`` header is forwarded.
        max_connections: pooled connections to all backends together.
        reasoning_split: hand agents the ``<think>...</think>`` a model wrote into a chat
            response's content as ``reasoning_content`` (the rest stays ``content``),
            streamed or not; the recorded call keeps the response as sampled
            (:mod:`voltrl.gateway.reasoning`).
    """

    def __init__(
        self,
        store: Store,
        backends: Sequence[str],
        *,
        model: str | None = None,
        model_for_agent: Callable[[str | None], str | None] | None = None,
        resources_version: Callable[[], int | None] | None = None,
        trace_header: str = "x-rollout-id",
        max_body_bytes: int = 32 * 1024 * 1024,
        retries: int = 3,
        backoff_s: float = 0.25,
        max_backoff_s: float = 8.0,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        pause_wait_s: float = 300.0,
        pause_retry_after_s: float = 5.0,
        request_token_ids: bool = True,
        backend_api_key: str | None = None,
        max_connections: int = 1024,
        reasoning_split: bool = False,
    ) -> None:
        if not backends:
            raise ValueError("Gateway needs at least one backend URL")
        self.store = store
        self.backends = [b.rstrip("/") for b in backends]
        self.model = model
        self.model_for_agent = model_for_agent
        self.resources_version = resources_version
        self.trace_header = trace_header.lower()
        self.max_body_bytes = max_body_bytes
        self.backoff = Backoff(retries, backoff_s, max_backoff_s)
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.pause_wait_s, self.pause_retry_after_s = pause_wait_s, pause_retry_after_s
        self.request_token_ids = request_token_ids
        self.backend_api_key = backend_api_key
        self.max_connections = max_connections
        self.reasoning_split = reasoning_split
        self._session: aiohttp.ClientSession | None = None
        self._pins: OrderedDict[str, int] = OrderedDict()
        self._pinned = [0] * len(self.backends)
        self._load = [0] * len(self.backends)
        self._known: dict[tuple[str, str], None] = {}
        self._paused = False
        self._closed = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._inflight = 0
        self._waiting = 0
        self._writes: set[asyncio.Task[Any]] = set()

    # ---- public control ---------------------------------------------------------------
    @property
    def app(self) -> Gateway:
        """The ASGI app (the gateway itself): run it standalone or mount it at a server's root."""
        return self

    @property
    def is_paused(self) -> bool:
        """Whether new calls are being held back."""
        return self._paused

    @property
    def inflight(self) -> int:
        """Calls being served right now."""
        return self._inflight

    @property
    def waiting(self) -> int:
        """Calls held back by a pause, waiting to go ahead."""
        return self._waiting

    async def pause(self) -> None:
        """Stop admitting new calls and return once every call in flight has finished
        (and been recorded). New calls wait up to ``pause_wait_s``, then get 429."""
        self._paused = True
        self._resumed.clear()
        while self._inflight:
            await self._idle.wait()

    async def close(self) -> None:
        """Take no more calls (new ones, and those waiting while paused, get 503 at once)
        and return once every call in flight has finished: what an algorithm does before it
        stops the backends, so the rollouts of an ending run fail fast instead of retrying
        against a stopped backend."""
        self._closed = True
        self._resumed.set()  # wake the waiting calls: they are refused
        while self._inflight:
            await self._idle.wait()

    def resume(self) -> None:
        """Admit calls again; the ones waiting go ahead."""
        self._paused = False
        self._resumed.set()

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """``async with gateway.paused():`` drains in-flight calls, holds new ones for the
        duration of the block (e.g. a weight update), then resumes."""
        await self.pause()
        try:
            yield
        finally:
            self.resume()

    async def aclose(self) -> None:
        """Wait for pending store writes and close the pooled backend connections."""
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- ASGI entry -------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            await self._handle(scope, receive, send)
        except GatewayHTTPError as e:
            await _send_bytes(send, e.status, e.body(), [_JSON, *e.headers])

    async def _lifespan(self, receive: ASGIReceive, send: ASGISend) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _handle(self, scope: dict[str, Any], receive: ASGIReceive, send: ASGISend) -> None:
        path = _route_path(scope)
        rollout_id = attempt_id = agent_name = None
        if path.startswith("/rollouts/"):
            parts = path.split("/")
            # "", "rollouts", rid, "attempts", aid, ["agents", name,] "v1", endpoint...
            if len(parts) < 7 or parts[3] != "attempts":
                raise GatewayHTTPError(404, f"no route {path!r}", type="not_found_error")
            rollout_id, attempt_id = unquote(parts[2]), unquote(parts[4])
            rest = parts[5:]
            if rest[0] == "agents" and len(rest) >= 3:
                agent_name, rest = unquote(rest[1]), rest[2:]
            endpoint = unquote("/" + "/".join(rest))
        else:
            endpoint = unquote(path)
        headers = _headers(scope)
        method = scope["method"]
        if endpoint == "/v1/models":
            if method != "GET":
                raise GatewayHTTPError(405, f"{method} is not allowed on {endpoint}")
            await self._models(send)
            return
        kind = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}.get(endpoint)
        if kind is None:
            message = f"no route {path!r}"
            if endpoint.startswith("/v1/"):
                message += _UNSERVED_API_ADVICE
            raise GatewayHTTPError(404, message, type="not_found_error")
        if method != "POST":
            raise GatewayHTTPError(405, f"{method} is not allowed on {endpoint}")
        if rollout_id is None:
            rollout_id = headers.get("x-rollout-id") or headers.get(self.trace_header)
            attempt_id = headers.get("x-attempt-id")
            if not rollout_id:
                raise GatewayHTTPError(
                    400,
                    "no rollout id: call /rollouts/{rollout_id}/attempts/{attempt_id}/v1/... or "
                    f"send an x-rollout-id (or {self.trace_header}) header",
                )
        agent_name = agent_name or headers.get("x-agent-name")
        raw = await self._read_body(headers, receive)
        call = self._parse(kind, raw, rollout_id, attempt_id or "", agent_name)
        call.attempt_id = await self._check_attempt(rollout_id, attempt_id)
        await self._admit()
        try:
            await self._proxy(call, headers, send)
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    # ---- request checks ---------------------------------------------------------------
    async def _read_body(self, headers: dict[str, str], receive: ASGIReceive) -> bytes:
        limit = self.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise GatewayHTTPError(
                413, f"request body of {declared} bytes is over the {limit}-byte limit"
            )
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise GatewayHTTPError(400, "client disconnected before sending its body")
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise GatewayHTTPError(413, f"request body is over the {limit}-byte limit")
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    @staticmethod
    def _parse(
        kind: str, raw: bytes, rollout_id: str, attempt_id: str, agent_name: str | None
    ) -> _Call:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise GatewayHTTPError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise GatewayHTTPError(400, "request body must be a JSON object")
        if kind == "chat":
            if not isinstance(body.get("messages"), list) or not body["messages"]:
                raise GatewayHTTPError(400, "'messages' must be a non-empty list")
            wants_logprobs = bool(body.get("logprobs"))
        else:
            if not isinstance(body.get("prompt"), str | list):
                raise GatewayHTTPError(400, "'prompt' must be a string or a list")
            wants_logprobs = body.get("logprobs") is not None
        n = body.get("n", 1)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise GatewayHTTPError(400, "'n' must be a positive integer")
        opts = body.get("stream_options")
        return _Call(
            kind=kind,
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            agent_name=agent_name,
            body=body,
            wants_ids=bool(body.get("return_token_ids")),
            wants_logprobs=wants_logprobs,
            wants_usage=isinstance(opts, dict) and bool(opts.get("include_usage")),
        )

    async def _check_attempt(self, rollout_id: str, attempt_id: str | None) -> str:
        if attempt_id and (rollout_id, attempt_id) in self._known:
            return attempt_id
        try:
            attempts = await self.store.get_attempts(rollout_id)
        except NotFoundError:
            raise GatewayHTTPError(
                404, f"unknown rollout {rollout_id!r}", type="not_found_error"
            ) from None
        if attempt_id is None:
            running = [a.attempt_id for a in attempts if a.status == "running"]
            if not running:
                raise GatewayHTTPError(
                    404,
                    f"rollout {rollout_id!r} has no running attempt; send x-attempt-id",
                    type="not_found_error",
                )
            return running[-1]
        if all(a.attempt_id != attempt_id for a in attempts):
            raise GatewayHTTPError(
                404,
                f"unknown attempt {attempt_id!r} of rollout {rollout_id!r}",
                type="not_found_error",
            )
        if len(self._known) >= _KNOWN_LIMIT:
            self._known.clear()
        self._known[(rollout_id, attempt_id)] = None
        return attempt_id

    async def _admit(self) -> None:
        """Wait while paused (up to ``pause_wait_s``), then count the call as in flight; a
        closed gateway answers 503 at once."""
        if self._closed:
            raise _closed()
        if self._paused:
            deadline = time.monotonic() + self.pause_wait_s
            self._waiting += 1
            try:
                while self._paused:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        retry_after = str(max(1, round(self.pause_retry_after_s))).encode()
                        raise GatewayHTTPError(
                            429,
                            "the gateway is paused (model weights are being updated); retry later",
                            type="rate_limit_error",
                            headers=[(b"retry-after", retry_after)],
                        )
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._resumed.wait(), left)
                    if self._closed:
                        raise _closed()
            finally:
                self._waiting -= 1
        self._inflight += 1
        self._idle.clear()

    # ---- backends ---------------------------------------------------------------------
    def _pick(self, rollout_id: str, avoid: int | None = None) -> int:
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

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.connect_timeout_s, sock_read=self.timeout_s
                ),
                auto_decompress=True,
            )
        return self._session

    async def _send_upstream(
        self, rollout_id: str | None, path: str, payload: bytes | None, headers: dict[str, str]
    ) -> tuple[int, aiohttp.ClientResponse]:
        """POST (or GET when ``payload`` is None) with retries (:attr:`backoff`), each retry
        on another replica when there is one. Returns the replica index and an open 2xx
        response, or raises :class:`GatewayHTTPError` once retries are spent."""
        session = self._client()
        idx = self._pick(rollout_id) if rollout_id is not None else 0
        tries = self.backoff.retries + 1

        def failed(status: int, problem: str, retry_after: str | None = None) -> Retry:
            message = f"backend failed after {tries} tries; last error: {problem}"
            return Retry(problem, GatewayHTTPError(status, message, type="api_error"), retry_after)

        async def attempt(tried: int) -> tuple[int, aiohttp.ClientResponse] | Retry:
            nonlocal idx
            if tried and rollout_id is not None and len(self.backends) > 1:
                idx = self._pick(rollout_id, avoid=idx)
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

    def _upstream_headers(self, client_headers: dict[str, str]) -> dict[str, str]:
        out = {"content-type": "application/json"}
        if self.backend_api_key is not None:
            out["authorization"] = f"Bearer {self.backend_api_key}"
        elif "authorization" in client_headers:
            out["authorization"] = client_headers["authorization"]
        return out

    async def _models(self, send: ASGISend) -> None:
        if self.model is not None:
            card = {"id": self.model, "object": "model", "created": 0, "owned_by": "voltrl"}
            await _send_bytes(send, 200, json.dumps({"object": "list", "data": [card]}).encode())
            return
        _, resp = await self._send_upstream(None, "/models", None, self._upstream_headers({}))
        body = await resp.read()
        resp.release()
        await _send_bytes(send, 200, body)

    # ---- the proxied call -------------------------------------------------------------
    def _upstream_body(self, call: _Call) -> dict[str, Any]:
        body = dict(call.body)
        if self.model is not None:
            body["model"] = self.model
        if self.model_for_agent is not None:
            body["model"] = self.model_for_agent(call.agent_name) or body.get("model")
        if self.request_token_ids:
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

    async def _proxy(self, call: _Call, client_headers: dict[str, str], send: ASGISend) -> None:
        version = self.resources_version() if self.resources_version is not None else None
        started = time.time()
        payload = json.dumps(self._upstream_body(call), separators=(",", ":")).encode()
        path = "/chat/completions" if call.kind == "chat" else "/completions"
        try:
            idx, resp = await self._send_upstream(
                call.rollout_id, path, payload, self._upstream_headers(client_headers)
            )
        except GatewayHTTPError as e:
            if 400 <= e.status < 500 and e.status not in RETRY_STATUSES:
                e = refusal(e)
                self._record_refusal(call, e, started)
            raise e from None
        meta = (self.backends[idx], version, started)
        try:
            if call.body.get("stream"):
                await self._relay_stream(call, resp, send, meta)
            else:
                raw = await resp.read()
                try:
                    data = json.loads(raw)
                except ValueError:
                    raise GatewayHTTPError(
                        502, f"backend sent a non-JSON response: {raw[:200]!r}", type="api_error"
                    ) from None
                calls = _calls_from_response(call, data, meta)
                _strip(call, data)
                if self.reasoning_split and call.kind == "chat":
                    split_messages(data)
                await self._record(calls)
                await _send_bytes(send, 200, json.dumps(data, separators=(",", ":")).encode())
        finally:
            resp.release()

    async def _relay_stream(
        self,
        call: _Call,
        resp: aiohttp.ClientResponse,
        send: ASGISend,
        meta: tuple[str, int | None, float],
    ) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        acc = _StreamAccumulator(call.kind)
        split = {} if self.reasoning_split and call.kind == "chat" else None
        recorded = False
        try:
            data_lines: list[bytes] = []
            async for line in resp.content:
                line = line.rstrip(b"\r\n")
                if line.startswith(b"data:"):
                    data_lines.append(line[5:].lstrip())
                    continue
                if line or not data_lines:
                    continue
                data, data_lines = b"\n".join(data_lines), []
                if data == b"[DONE]":
                    break
                out = self._relay_event(call, acc, data, split)
                if out is not None:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
            if split and (last := flush_deltas(split, acc.head)) is not None:
                out = b"data: " + json.dumps(last, separators=(",", ":")).encode() + b"\n\n"
                await send({"type": "http.response.body", "body": out, "more_body": True})
            recorded = True
            await self._record(acc.calls(call, meta))
        except (aiohttp.ClientError, TimeoutError) as e:
            err = GatewayHTTPError(502, f"backend stream broke off: {e!r}", type="api_error")
            out = b"data: " + err.body() + b"\n\n"
            await send({"type": "http.response.body", "body": out, "more_body": True})
        except GatewayHTTPError as e:
            out = b"data: " + e.body() + b"\n\n"
            await send({"type": "http.response.body", "body": out, "more_body": True})
        finally:
            if not recorded and acc.chunks:
                # Client went away or the backend broke off: keep what was sampled anyway.
                self._record_later(acc.calls(call, meta))
        await send({"type": "http.response.body", "body": _DONE, "more_body": False})

    @staticmethod
    def _relay_event(
        call: _Call,
        acc: _StreamAccumulator,
        data: bytes,
        split: dict[int, ReasoningSplitter] | None = None,
    ) -> bytes | None:
        """Accumulate one SSE event; return what the client should get (None: nothing).
        ``split``: the choices' reasoning splitters, when the split is on."""
        try:
            chunk = json.loads(data)
        except ValueError:
            return b"data: " + data + b"\n\n"
        if not isinstance(chunk, dict):
            return b"data: " + data + b"\n\n"
        acc.add(chunk)
        if split is not None:
            split_deltas(chunk, split)
        elif call.wants_ids and call.wants_logprobs and call.wants_usage:
            return b"data: " + data + b"\n\n"
        if not call.wants_usage:
            if not chunk.get("choices") and chunk.get("usage") is not None:
                return None
            chunk.pop("usage", None)
        _strip(call, chunk)
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    async def _record(self, calls: list[LLMCall]) -> None:
        """Write the calls; the write finishes even if this request is cancelled meanwhile."""
        task = self._track(self.store.add_llm_calls(calls))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise GatewayHTTPError(
                500, f"the call could not be recorded: {type(e).__name__}: {e}", type="api_error"
            ) from e

    def _record_refusal(self, call: _Call, error: GatewayHTTPError, started: float) -> None:
        """Record a call the backend refused (a prompt over the context, a bad parameter) as
        a ``gateway.refused`` span of its attempt, which the trajectory builder counts
        (``refused/<code>``); written in the background, like late call records."""
        span = Span(
            rollout_id=call.rollout_id,
            attempt_id=call.attempt_id,
            name=REFUSED_SPAN,
            start_time=started,
            end_time=time.time(),
            status="error",
            attributes={
                "http.response.status_code": error.status,
                "error.type": error.code or error.type,
                "error.message": error.message[:1000],
                "voltrl.agent_name": call.agent_name or "",
            },
        )
        self._track(self.store.add_spans([span])).add_done_callback(_log_write_failure)

    def _record_later(self, calls: list[LLMCall]) -> None:
        """Write the calls in the background (:meth:`aclose` waits for them); failures are
        logged, as there is no response left to report them in."""
        self._track(self.store.add_llm_calls(calls)).add_done_callback(_log_write_failure)

    def _track(self, write: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(write)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return task


def _log_write_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("gateway: LLM calls could not be recorded", exc_info=task.exception())


_UNSERVED_API_ADVICE = (
    ": the VoltRL gateway serves /v1/chat/completions and /v1/completions only (not the "
    "Responses API). With the OpenAI Agents SDK use voltrl.adapters.openai_agents.model(llm), "
    "a chat-completions model, or call "
    'agents.set_default_openai_api("chat_completions") before running the agent.'
)


# ---- small helpers ----------------------------------------------------------------------
def _closed() -> GatewayHTTPError:
    """What a call gets from a gateway that was closed (:meth:`Gateway.close`)."""
    return GatewayHTTPError(
        503, "the run is ending: this gateway takes no more calls", type="api_error"
    )


def _route_path(scope: dict[str, Any]) -> str:
    """The path below the app's mount point (Starlette's ``Mount`` keeps it in root_path),
    still percent-encoded, so that a segment holding an encoded ``/`` (an agent named
    ``team/role``) stays one segment; :meth:`Gateway._handle` decodes each."""
    raw = scope.get("raw_path")
    path: str = raw.decode("latin-1") if raw else quote(scope["path"])
    root: str = quote(scope.get("root_path", ""))
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("/", ""):
        path = path[len(root) :] or "/"
    return path.rstrip("/") or "/"


def _headers(scope: dict[str, Any]) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


async def _send_bytes(
    send: ASGISend, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    hdrs = [*(headers or [_JSON]), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})
