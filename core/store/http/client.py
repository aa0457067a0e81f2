"""The store over HTTP: :class:`HTTPStore` talks to a store server
(:mod:`voltrl.store.http.endpoints`) and behaves exactly like a local store, so a runner on
another machine cannot tell the difference.

This module also defines the wire format of the request and response bodies that are not
records themselves (records such as :class:`~voltrl.types.Rollout` travel as-is). The server
imports them from here, so a worker needs only ``aiohttp`` and ``pydantic`` to talk to a store.

Few requests: every write takes a batch (``enqueue`` many tasks, ``add_spans``/``add_llm_calls``
/``add_rewards`` many records), and a runner reports a whole attempt (status, reward, emitted
rewards, spans) in the one ``complete`` request, so a rollout costs three requests: enqueue,
claim, complete. Connections are kept alive and reused (one pool per ``HTTPStore`` and event
loop); bodies are serialised and parsed by pydantic's JSON code directly.

Retries (:mod:`voltrl.retry`, as the gateway's): every call is retried, with exponential backoff
and jitter, on transport errors (connection refused or reset, timeouts) and on 408, 429 and
500/502/503/504 answers, waiting at least a ``Retry-After`` (up to ``max_backoff_s``). The
defaults (12 retries, pauses up to 8 s) ride out a store server restart of at least 30 s, as
a long run needs; one-off checks pass ``retries=0`` to fail at once. Reads
are safe to repeat. Every write carries an ``X-Request-Id`` that stays the same across the
retries of one call, and the server runs each request id once and answers repeats with the
first answer (even while the first is still running, as a long-poll ``claim`` may be), so a
retried ``claim`` never claims twice and a retried ``enqueue`` never queues twice. The server
keeps those answers in memory for a while (``dedup_ttl_s``, ``dedup_max_bytes``): if it
restarts, or forgets the answer, between applying a write and receiving its retry, the retry is
applied again (for ``complete`` that answers :class:`~voltrl.errors.StaleAttemptError`; a
second ``claim`` leaves the first attempt to expire with its lease). A connection that was
refused never reached the server, so retrying it is always safe. Any other failure (an error
answer, a body that is not what the route returns) raises a
:class:`~voltrl.errors.StoreError`: a call never answers "nothing" for a failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar
from urllib.parse import quote

import aiohttp
from pydantic import BaseModel, TypeAdapter, ValidationError

from voltrl._http import CLIENT_KEEPALIVE_S
from voltrl._redact import redact
from voltrl.errors import NotFoundError, StaleAttemptError, StoreError
from voltrl.resources import Resources
from voltrl.retry import RETRY_STATUSES, Backoff, Retry
from voltrl.store.base import DEFAULT_LEASE_S, Store
from voltrl.store.browse import RolloutCount, RolloutPage, RolloutQuery
from voltrl.types import (
    Attempt,
    AttemptResult,
    Claim,
    LLMCall,
    Model,
    Reward,
    Rollout,
    RolloutMode,
    RolloutStatus,
    Run,
    Span,
    Task,
)

logger = logging.getLogger(__name__)

API_PREFIX = "/v1/store"
"""Where the store routes live on a server (``store_app`` mounts them here)."""

REQUEST_ID_HEADER = "X-Request-Id"
"""Header naming one logical write; the server applies each request id at most once."""

T = TypeVar("T")


# ---- wire format ----------------------------------------------------------------------------
class EnqueueRequest(Model):
    """Body of ``POST /rollouts``: :meth:`Store.enqueue`'s arguments."""

    tasks: list[Task]
    mode: RolloutMode = "train"
    run_id: str | None = None
    resources_version: int | None = None
    max_attempts: int = 3
    timeout_s: float | None = None
    retry_agent_errors: bool = True


class StartRolloutRequest(Model):
    """Body of ``POST /rollouts/started``: :meth:`Store.start_rollout`'s arguments."""

    task: Task
    worker_id: str
    mode: RolloutMode
    run_id: str | None = None
    resources_version: int | None = None
    lease_s: float = DEFAULT_LEASE_S


class ClaimRequest(Model):
    """Body of ``POST /claims``. The server caps ``wait_s`` at its ``max_wait_s``."""

    worker_id: str
    lease_s: float = DEFAULT_LEASE_S
    wait_s: float = 0.0


class HeartbeatRequest(Model):
    """Body of ``POST /heartbeats``."""

    attempt_ids: list[str]
    lease_s: float = DEFAULT_LEASE_S


class HeartbeatResponse(Model):
    """Answer of ``POST /heartbeats``: the attempts that no longer own their rollout."""

    stale: list[str]


class ExpireResponse(Model):
    """Answer of ``POST /leases/expire``: how many attempts ended."""

    expired: int


class WaitRequest(Model):
    """Body of ``POST /rollouts/wait``. The server caps ``timeout_s`` (None: the cap)."""

    rollout_ids: list[str]
    timeout_s: float | None = None


class QueryRequest(Model):
    """Body of ``POST /rollouts/query``: :meth:`Store.query_rollouts`'s filters."""

    run_id: str | None = None
    status: list[RolloutStatus] | None = None
    mode: RolloutMode | None = None
    since: float | None = None
    until: float | None = None
    rollout_ids: list[str] | None = None
    limit: int | None = None


class LLMCallsRequest(Model):
    """Body of ``POST /llm_calls``."""

    calls: list[LLMCall]


class SpansRequest(Model):
    """Body of ``POST /spans``."""

    spans: list[Span]


class RewardsRequest(Model):
    """Body of ``POST /rewards``."""

    rewards: list[Reward]


class ErrorDetail(Model):
    """What went wrong: ``type`` names the error class (``NotFoundError``, ...)."""

    type: str
    message: str


class ErrorResponse(Model):
    """Body of every error answer: ``{"error": {"type": ..., "message": ...}}``."""

    error: ErrorDetail


class HealthResponse(Model):
    """Answer of ``GET /health``."""

    status: Literal["ok"] = "ok"


_RUN = TypeAdapter(Run)
_RUNS = TypeAdapter(list[Run])
_RESOURCES = TypeAdapter(Resources)
_MAYBE_RESOURCES = TypeAdapter(Resources | None)
_ROLLOUT = TypeAdapter(Rollout)
_ROLLOUTS = TypeAdapter(list[Rollout])
_MAYBE_CLAIM = TypeAdapter(Claim | None)
_CLAIM = TypeAdapter(Claim)
_HEARTBEAT = TypeAdapter(HeartbeatResponse)
_EXPIRE = TypeAdapter(ExpireResponse)
_ATTEMPTS = TypeAdapter(list[Attempt])
_LLM_CALLS = TypeAdapter(list[LLMCall])
_SPANS = TypeAdapter(list[Span])
_REWARDS = TypeAdapter(list[Reward])
_NONE = TypeAdapter(None)
_PAGE = TypeAdapter(RolloutPage)
_COUNTS = TypeAdapter(list[RolloutCount])
_ERROR = TypeAdapter(ErrorResponse)

_TYPED_ERRORS: dict[str, type[StoreError]] = {
    "NotFoundError": NotFoundError,
    "StaleAttemptError": StaleAttemptError,
}


def error_from_response(status: int, content: bytes, what: str) -> StoreError:
    """The typed exception an error answer of a store server stands for.

    ``status`` and ``content`` are the answer's; ``what`` names the request (``POST /claims``).
    ``NotFoundError`` and ``StaleAttemptError`` come back as themselves, with the server's
    message; anything else (bad request, auth, a proxy's error page) is a :class:`StoreError`
    naming the status.
    """
    try:
        detail = _ERROR.validate_json(content).error
    except ValidationError:
        text = content.decode("utf-8", "replace").strip()[:500] or "(empty body)"
        return StoreError(
            f"store server answered {status} to {what} without a VoltRL error body: {text}"
        )
    if (cls := _TYPED_ERRORS.get(detail.type)) is not None:
        return cls(detail.message)
    return StoreError(f"store server answered {status} {detail.type}: {detail.message}")


_SKIPPED_HEADERS = ("Accept", "Accept-Encoding")
"""Headers aiohttp adds by default that a store server does not use: fewer to send and parse."""

_RETRY_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)
"""Transport failures a call retries: refused, reset or dropped connections, timeouts."""


class HTTPStore(Store):
    """A :class:`~voltrl.store.base.Store` served by a store server at ``url``.

    ``url`` is the server's base URL (``http://host:port``); the routes live under
    ``/v1/store``. ``token`` is sent as a bearer token. ``timeout_s`` bounds one request (a
    long-poll gets its wait on top); ``retries`` is how many times a failed request is
    repeated (see the module docstring for which failures). Long waits (``claim(wait_s=...)``,
    ``wait_for_rollouts``) are split into requests of at most ``long_poll_s`` seconds.

    One ``aiohttp`` session (a pool of kept-alive connections, at most ``max_connections``) is
    created lazily for the running event loop and replaced when the loop changes, so a process
    may call ``asyncio.run`` more than once. Idle connections are closed after
    ``keepalive_s``, before the server does (:data:`voltrl._http.CLIENT_KEEPALIVE_S`), so a
    request rarely meets a connection the server is closing. Use one ``HTTPStore`` from one
    event loop at a time; :meth:`close` releases the connections.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout_s: float = 30.0,
        retries: int = 12,
        backoff_s: float = 0.1,
        max_backoff_s: float = 8.0,
        long_poll_s: float = 25.0,
        max_connections: int = 512,
        keepalive_s: float = CLIENT_KEEPALIVE_S,
    ) -> None:
        if retries < 0 or timeout_s <= 0 or long_poll_s <= 0:
            raise ValueError("need retries >= 0, timeout_s > 0 and long_poll_s > 0")
        self.url = url.rstrip("/")
        self.token = token
        self._base = self.url + API_PREFIX
        self._shown = redact(self.url)  # in messages: a password in the URL hidden
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout_s = timeout_s
        self._timeout = self._request_timeout(0.0)
        self._backoff = Backoff(retries, backoff_s, max_backoff_s)
        self._long_poll_s = long_poll_s
        self._max_connections = max_connections
        self._keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"HTTPStore({self._shown!r})"

    # ---- transport ----------------------------------------------------------------------
    def _http(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session_loop is not loop:
            if self._session is not None:
                _forget(self._session, self._session_loop)
            connector = aiohttp.TCPConnector(
                limit=self._max_connections, limit_per_host=0, keepalive_timeout=self._keepalive_s
            )
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                connector=connector,
                skip_auto_headers=_SKIPPED_HEADERS,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
            self._session_loop = loop
        return self._session

    def _request_timeout(self, wait_s: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            sock_connect=self._timeout_s, sock_read=self._timeout_s + wait_s
        )

    async def _call(
        self,
        method: str,
        path: str,
        adapter: TypeAdapter[T],
        *,
        body: BaseModel | None = None,
        params: Mapping[str, Any] | None = None,
        write: bool = False,
        wait_s: float = 0.0,
    ) -> T:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if write:
            headers[REQUEST_ID_HEADER] = uuid.uuid4().hex
        content = body.model_dump_json().encode() if body is not None else None
        timeout = self._timeout if wait_s <= 0 else self._request_timeout(wait_s)
        query = {k: str(v) for k, v in (params or {}).items() if v is not None} or None
        session = self._http()
        url = self._base + path

        async def attempt(tried: int) -> T | Retry:
            try:
                async with session.request(
                    method, url, data=content, params=query, headers=headers, timeout=timeout
                ) as response:
                    status, answer = response.status, await response.read()
                    retry_after = response.headers.get("Retry-After") if status >= 300 else None
            except _RETRY_ERRORS as exc:
                problem = f"{type(exc).__name__}: {exc}"
                error = StoreError(
                    f"store server {self._shown} unreachable: {problem} "
                    f"({method} {path}, {tried + 1} tries)"
                )
                error.__cause__ = exc
                return Retry(problem, error)
            if 200 <= status < 300:
                try:
                    return adapter.validate_json(answer)
                except ValidationError as exc:
                    raise StoreError(
                        f"store server {self._shown} answered {method} {path} with a body "
                        f"that is not what the route returns: {exc}"
                    ) from exc
            error = error_from_response(status, answer, f"{method} {path}")
            if status not in RETRY_STATUSES:
                raise error
            return Retry(f"status {status}", error, retry_after)

        return await self._backoff.run(attempt, f"store request {method} {path}", logger)

    # ---- runs and resources -------------------------------------------------------------
    async def add_run(self, run: Run) -> Run:
        return await self._call("POST", "/runs", _RUN, body=run, write=True)

    async def list_runs(self) -> list[Run]:
        return await self._call("GET", "/runs", _RUNS)

    async def add_resources(self, resources: Resources) -> Resources:
        return await self._call("POST", "/resources", _RESOURCES, body=resources, write=True)

    async def get_resources(self, version: int | None = None) -> Resources | None:
        return await self._call("GET", "/resources", _MAYBE_RESOURCES, params={"version": version})

    # ---- queue --------------------------------------------------------------------------
    async def enqueue(
        self,
        tasks: Sequence[Task],
        *,
        mode: RolloutMode = "train",
        run_id: str | None = None,
        resources_version: int | None = None,
        max_attempts: int = 3,
        timeout_s: float | None = None,
        retry_agent_errors: bool = True,
    ) -> list[Rollout]:
        body = EnqueueRequest(
            tasks=list(tasks),
            mode=mode,
            run_id=run_id,
            resources_version=resources_version,
            max_attempts=max_attempts,
            timeout_s=timeout_s,
            retry_agent_errors=retry_agent_errors,
        )
        return await self._call("POST", "/rollouts", _ROLLOUTS, body=body, write=True)

    async def claim(
        self, worker_id: str, *, lease_s: float = DEFAULT_LEASE_S, wait_s: float = 0.0
    ) -> Claim | None:
        deadline = time.monotonic() + wait_s
        while True:
            chunk = max(0.0, min(deadline - time.monotonic(), self._long_poll_s))
            body = ClaimRequest(worker_id=worker_id, lease_s=lease_s, wait_s=chunk)
            claim = await self._call(
                "POST", "/claims", _MAYBE_CLAIM, body=body, write=True, wait_s=chunk
            )
            if claim is not None or time.monotonic() >= deadline:
                return claim

    async def start_rollout(
        self,
        task: Task,
        *,
        worker_id: str,
        mode: RolloutMode,
        run_id: str | None = None,
        resources_version: int | None = None,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> Claim:
        body = StartRolloutRequest(
            task=task,
            worker_id=worker_id,
            mode=mode,
            run_id=run_id,
            resources_version=resources_version,
            lease_s=lease_s,
        )
        return await self._call("POST", "/rollouts/started", _CLAIM, body=body, write=True)

    async def heartbeat(
        self, attempt_ids: Sequence[str], *, lease_s: float = DEFAULT_LEASE_S
    ) -> list[str]:
        body = HeartbeatRequest(attempt_ids=list(attempt_ids), lease_s=lease_s)
        answer = await self._call("POST", "/heartbeats", _HEARTBEAT, body=body, write=True)
        return answer.stale

    async def complete(self, attempt_id: str, result: AttemptResult) -> Rollout:
        path = f"/attempts/{quote(attempt_id, safe='')}/complete"
        return await self._call("POST", path, _ROLLOUT, body=result, write=True)

    async def cancel(self, rollout_id: str) -> Rollout:
        path = f"/rollouts/{quote(rollout_id, safe='')}/cancel"
        return await self._call("POST", path, _ROLLOUT, write=True)

    async def expire_leases(self) -> int:
        answer = await self._call("POST", "/leases/expire", _EXPIRE, write=True)
        return answer.expired

    async def wait_for_rollouts(
        self, rollout_ids: Sequence[str], *, timeout_s: float | None = None
    ) -> list[Rollout]:
        ids = list(rollout_ids)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(dict.fromkeys(ids))
        done: dict[str, Rollout] = {}
        while True:
            left = self._long_poll_s if deadline is None else deadline - time.monotonic()
            chunk = max(0.0, min(left, self._long_poll_s))
            body = WaitRequest(rollout_ids=pending, timeout_s=chunk)
            for r in await self._call("POST", "/rollouts/wait", _ROLLOUTS, body=body, wait_s=chunk):
                done[r.rollout_id] = r
            pending = [i for i in pending if i not in done]
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                return [done[i] for i in ids if i in done]

    # ---- records ------------------------------------------------------------------------
    async def add_llm_calls(self, calls: Sequence[LLMCall]) -> list[LLMCall]:
        body = LLMCallsRequest(calls=list(calls))
        return await self._call("POST", "/llm_calls", _LLM_CALLS, body=body, write=True)

    async def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        body = SpansRequest(spans=list(spans))
        return await self._call("POST", "/spans", _SPANS, body=body, write=True)

    async def add_rewards(self, rewards: Sequence[Reward]) -> None:
        body = RewardsRequest(rewards=list(rewards))
        await self._call("POST", "/rewards", _NONE, body=body, write=True)

    # ---- queries ------------------------------------------------------------------------
    async def get_rollout(self, rollout_id: str) -> Rollout:
        return await self._call("GET", f"/rollouts/{quote(rollout_id, safe='')}", _ROLLOUT)

    async def query_rollouts(
        self,
        *,
        run_id: str | None = None,
        status: RolloutStatus | Sequence[RolloutStatus] | None = None,
        mode: RolloutMode | None = None,
        since: float | None = None,
        until: float | None = None,
        rollout_ids: Sequence[str] | None = None,
        limit: int | None = None,
    ) -> list[Rollout]:
        body = QueryRequest(
            run_id=run_id,
            status=[status] if isinstance(status, str) else list(status) if status else None,
            mode=mode,
            since=since,
            until=until,
            rollout_ids=None if rollout_ids is None else list(rollout_ids),
            limit=limit,
        )
        return await self._call("POST", "/rollouts/query", _ROLLOUTS, body=body)

    async def browse_rollouts(self, query: RolloutQuery) -> RolloutPage:
        return await self._call("POST", "/rollouts/browse", _PAGE, body=query)

    async def rollout_counts(self, run_id: str) -> list[RolloutCount]:
        return await self._call("GET", f"/runs/{quote(run_id, safe='')}/rollout_counts", _COUNTS)

    async def get_attempts(self, rollout_id: str) -> list[Attempt]:
        path = f"/rollouts/{quote(rollout_id, safe='')}/attempts"
        return await self._call("GET", path, _ATTEMPTS)

    async def get_llm_calls(self, rollout_id: str, attempt_id: str | None = None) -> list[LLMCall]:
        path = f"/rollouts/{quote(rollout_id, safe='')}/llm_calls"
        return await self._call("GET", path, _LLM_CALLS, params={"attempt_id": attempt_id})

    async def get_spans(self, rollout_id: str, attempt_id: str | None = None) -> list[Span]:
        path = f"/rollouts/{quote(rollout_id, safe='')}/spans"
        return await self._call("GET", path, _SPANS, params={"attempt_id": attempt_id})

    async def get_rewards(self, rollout_id: str, attempt_id: str | None = None) -> list[Reward]:
        path = f"/rollouts/{quote(rollout_id, safe='')}/rewards"
        return await self._call("GET", path, _REWARDS, params={"attempt_id": attempt_id})

    async def close(self) -> None:
        """Close the pooled connections of the current event loop's session."""
        session, self._session = self._session, None
        if session is not None:
            if self._session_loop is asyncio.get_running_loop():
                await session.close()
            else:
                _forget(session, self._session_loop)
        self._session_loop = None


def _forget(session: aiohttp.ClientSession, loop: asyncio.AbstractEventLoop | None) -> None:
    """Drop a session of another event loop (``loop``, usually finished), which cannot be
    closed from this one: its connections went with that loop. Marking a finished loop's pool
    closed keeps aiohttp from reporting it as leaked when it is garbage-collected."""
    connector = session.connector
    session.detach()
    if connector is not None and loop is not None and loop.is_closed():
        connector._close()  # only flags the pool closed: its loop is gone
