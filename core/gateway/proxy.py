"""The gateway: an OpenAI-compatible reverse proxy that records every call with its token ids.

The gateway forwards ``/v1/chat/completions`` and ``/v1/completions`` to a backend replica
(sticky per rollout), asks it for token ids and logprobs (vLLM's ``return_token_ids`` and
``logprobs``), stores one :class:`~voltrl.types.LLMCall` per choice, and returns the response the
client asked for: the extra fields are removed unless the client requested them. Streaming
(SSE), ``n > 1`` and tool calls pass through. The store write is awaited before the last
response bytes are sent, so when a client's call returns, its record is in the store.

Each call goes attribute → admit → forward → relay → record (:meth:`Gateway._handle`), a module
each: :mod:`~voltrl.gateway.attribution` (which rollout, attempt and agent),
:mod:`~voltrl.gateway.drain` (paused, closed), :mod:`~voltrl.gateway.upstream` (replica and
retries), :mod:`~voltrl.gateway.relay` (the answer back) and :mod:`~voltrl.gateway.records`.

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
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from voltrl.gateway._asgi import (
    JSON_HEADER,
    ASGIReceive,
    ASGISend,
    request_headers,
    send_bytes,
)
from voltrl.gateway.attribution import (
    AttemptCheck,
    attribute,
    call_kind,
    parse_call,
    read_body,
    target_of,
)
from voltrl.gateway.drain import CLIENT_GONE, Drain, Flight, cut_off_error
from voltrl.gateway.errors import GatewayHTTPError, refusal
from voltrl.gateway.records import Call, Recorder
from voltrl.gateway.relay import relay_response, relay_stream
from voltrl.gateway.upstream import Upstream, backend_body, fill_sampling
from voltrl.retry import RETRY_STATUSES, Backoff
from voltrl.store.base import Store


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
        pause_deadline_s: how long :meth:`pause` waits for the calls in flight; what is still
            running then is cut off (answered 503, which OpenAI clients retry, and recorded
            as abandoned) so that a weight update never waits on a runaway generation
            (None: no deadline).
        request_token_ids: send vLLM's ``return_token_ids``; turn off for hosted APIs that
            reject unknown fields (calls are then recorded without token ids).
        backend_api_key: sent as the bearer token to backends; when None the client's
            ``Authorization`` header is forwarded.
        backend_headers: sent to backends with every request (a provider's key header, such
            as Azure OpenAI's ``api-key``; the client's own headers are not forwarded).
        max_connections: pooled connections to all backends together.
        sampling_for: called with a call's rollout mode (``train``, ``val``, ``dev``...); the
            sampling fields it returns (``max_tokens``, ``temperature``...) fill those the
            request leaves out, so a run's sampling reaches agents that never pass it (a
            request's own value wins; the record shows what was sent).
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
        pause_deadline_s: float | None = 30.0,
        request_token_ids: bool = True,
        backend_api_key: str | None = None,
        backend_headers: Mapping[str, str] | None = None,
        max_connections: int = 1024,
        reasoning_split: bool = False,
        sampling_for: Callable[[str], Mapping[str, Any] | None] | None = None,
    ) -> None:
        if not backends:
            raise ValueError("Gateway needs at least one backend URL")
        self.store = store
        self.model = model
        self.model_for_agent = model_for_agent
        self.resources_version = resources_version
        self.trace_header = trace_header.lower()
        self.max_body_bytes = max_body_bytes
        self.request_token_ids = request_token_ids
        self.reasoning_split = reasoning_split
        self.sampling_for = sampling_for
        self._upstream = Upstream(
            backends,
            Backoff(retries, backoff_s, max_backoff_s),
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            api_key=backend_api_key,
            max_connections=max_connections,
            extra_headers=backend_headers,
        )
        self._attempts = AttemptCheck(store)
        self._drain = Drain(pause_wait_s, pause_retry_after_s, pause_deadline_s)
        self._recorder = Recorder(store)

    # ---- public control ---------------------------------------------------------------
    @property
    def app(self) -> Gateway:
        """The ASGI app (the gateway itself): run it standalone or mount it at a server's root."""
        return self

    @property
    def backends(self) -> list[str]:
        """The replicas' base URLs, as calls are sent to them."""
        return self._upstream.backends

    @property
    def backoff(self) -> Backoff:
        """The retries of a backend request and the waits between them."""
        return self._upstream.backoff

    @property
    def is_paused(self) -> bool:
        """Whether new calls are being held back."""
        return self._drain.paused

    @property
    def inflight(self) -> int:
        """Calls being served right now."""
        return self._drain.inflight

    @property
    def waiting(self) -> int:
        """Calls held back by a pause, waiting to go ahead."""
        return self._drain.waiting

    @property
    def cut_off(self) -> dict[str, int]:
        """Calls cut off in flight so far, by reason (:data:`~voltrl.gateway.drain.CUT_REASONS`):
        their client disconnected, a pause outlasted ``pause_deadline_s``, the gateway
        stopped."""
        return dict(self._drain.cut_off)

    async def pause(self, deadline_s: float | None = None) -> None:
        """Stop admitting new calls and return once every call in flight has finished
        (and been recorded), or after ``deadline_s`` (default ``pause_deadline_s``) has cut
        off the rest. New calls wait up to ``pause_wait_s``, then get 429."""
        await self._drain.pause(deadline_s)

    async def close(self) -> None:
        """Take no more calls (new ones, and those waiting while paused, get 503 at once)
        and return once every call in flight has finished: what an algorithm does before it
        stops the backends, so the rollouts of an ending run fail fast instead of retrying
        against a stopped backend."""
        await self._drain.close()

    async def stop_calls(self, grace_s: float) -> None:
        """Take no more calls, give those in flight ``grace_s`` seconds to finish, then cut
        the rest short (each answered 503 if its response has not started): what stopping the
        gateway does, so a run stopped early (its rollouts cancelled) does not wait on their
        calls or leave the server to cancel them. Returns once no call is in flight."""
        try:
            # not asyncio.wait_for: it can lose a cancellation (see Notifier.wait)
            async with asyncio.timeout(grace_s):
                await self._drain.close()
        except TimeoutError:
            self._drain.abort()
            await self._drain.close()

    def resume(self) -> None:
        """Admit calls again; the ones waiting go ahead."""
        self._drain.resume()

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """``async with gateway.paused():`` drains in-flight calls, holds new ones for the
        duration of the block (e.g. a weight update), then resumes."""
        try:
            await self.pause()
            yield
        finally:
            self.resume()

    async def aclose(self) -> None:
        """Wait for pending store writes and close the pooled backend connections."""
        await self._recorder.wait()
        await self._upstream.aclose()

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
            await send_bytes(send, e.status, e.body(), [JSON_HEADER, *e.headers])

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
        target = target_of(scope)
        headers = request_headers(scope)
        method = scope["method"]
        if target.endpoint == "/v1/models":
            if method != "GET":
                raise GatewayHTTPError(405, f"{method} is not allowed on {target.endpoint}")
            await self._models(send)
            return
        # attribute: which call, of which rollout, attempt and agent
        kind = call_kind(target, method)
        rollout_id, attempt_id, agent_name = attribute(target, headers, self.trace_header)
        raw = await read_body(headers, receive, self.max_body_bytes)
        call = parse_call(kind, raw, rollout_id, attempt_id or "", agent_name)
        call.attempt_id = await self._attempts.resolve(rollout_id, attempt_id)
        if self.sampling_for is not None:
            defaults = self.sampling_for(await self._attempts.mode(rollout_id))
            fill_sampling(call.body, defaults or {})
        # admit (or hold back while paused), then forward, relay and record
        flight = await self._drain.admit()
        watcher = asyncio.ensure_future(_cut_when_gone(receive, self._drain, flight))
        began = time.time()
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            elif not message.get("more_body", False):
                flight.responded = True  # before the send: a disconnect now cuts nothing
            await send(message)

        try:
            await self._forward(call, headers, tracked, flight.commit)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            reason = flight.cut_reason
            if reason is None or (task is not None and task.uncancel() > 0):
                raise  # not (only) cut off by the gateway
            self._recorder.record_abandoned(call, reason, began)
            if reason == CLIENT_GONE:
                return  # nobody to answer
            if not started:
                raise cut_off_error(reason) from None
            # a stream under way: an error event, the end (bounded: a client that stopped
            # reading must not hold up a pause)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_LAST_WORDS_S):
                    error = cut_off_error(reason).body()
                    body = b"data: " + error + b"\n\n"
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            self._drain.leave(flight)

    async def _models(self, send: ASGISend) -> None:
        if self.model is not None:
            card = {"id": self.model, "object": "model", "created": 0, "owned_by": "voltrl"}
            await send_bytes(send, 200, json.dumps({"object": "list", "data": [card]}).encode())
            return
        _, resp = await self._upstream.send(None, "/models", None, self._upstream.headers({}))
        body = await resp.read()
        resp.release()
        await send_bytes(send, 200, body)

    # ---- the proxied call -------------------------------------------------------------
    async def _forward(
        self,
        call: Call,
        client_headers: dict[str, str],
        send: ASGISend,
        commit: Callable[[], None],
    ) -> None:
        """Send the call to a replica, then relay its answer, recording it on the way
        (``commit`` once the answer is complete); a call the backend refused is recorded as a
        refusal span."""
        version = self.resources_version() if self.resources_version is not None else None
        started = time.time()
        body = backend_body(
            call,
            model=self.model,
            model_for_agent=self.model_for_agent,
            request_token_ids=self.request_token_ids,
        )
        payload = json.dumps(body, separators=(",", ":")).encode()
        path = "/chat/completions" if call.kind == "chat" else "/completions"
        try:
            idx, resp = await self._upstream.send(
                call.rollout_id, path, payload, self._upstream.headers(client_headers)
            )
        except GatewayHTTPError as e:
            if 400 <= e.status < 500 and e.status not in RETRY_STATUSES:
                e = refusal(e)
                self._recorder.record_refusal(call, e, started)
            raise e from None
        meta = (self.backends[idx], version, started)
        relay = relay_stream if call.body.get("stream") else relay_response
        try:
            split = self.reasoning_split
            await relay(
                call, resp, send, meta, self._recorder, reasoning_split=split, commit=commit
            )
        except BaseException:
            resp.close()  # the backend sees its client go and stops generating
            raise
        finally:
            resp.release()


_LAST_WORDS_S = 2.0
"""How long a cut-off stream's error event may take to go out."""


async def _cut_when_gone(receive: ASGIReceive, drain: Drain, flight: Flight) -> None:
    """Cut ``flight`` off when its client disconnects (the request body has been read, so
    the next message is the disconnect): the backend's generation is closed with it, instead
    of running on for nobody and holding up the next pause."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # a server whose receive fails: nothing to watch
        return
    drain.cut(CLIENT_GONE, flight)
