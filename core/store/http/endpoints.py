"""The store server: every :class:`~voltrl.store.base.Store` method as a typed REST endpoint.

:func:`store_router` builds the routes (an ``APIRouter`` to include under ``/v1/store`` next to
other routes in one server); :func:`store_app` is the app serving them (and, when given,
another app such as the gateway on every other path). :class:`~voltrl.store.http.client.HTTPStore`
is the matching client.

Routes (under ``/v1/store``; with a token, every one but ``/health`` needs
``Authorization: Bearer <token>``, checked by :class:`~voltrl._http.auth.BearerAuth` around
the whole app):

========  ==================================  ==========================================
GET       /health                             liveness, no auth
POST      /v1/traces                          OTLP/HTTP trace export (:mod:`~.otlp`)
POST      /runs                               ``add_run``
GET       /runs                               ``list_runs``
POST      /resources                          ``add_resources``
GET       /resources?version=N                ``get_resources`` (latest without version)
POST      /rollouts                           ``enqueue``
POST      /claims                             ``claim``, long-poll (``wait_s`` capped)
POST      /rollouts/started                   ``start_rollout``
POST      /heartbeats                         ``heartbeat``
POST      /attempts/{attempt_id}/complete     ``complete``
POST      /rollouts/{rollout_id}/cancel       ``cancel``
POST      /leases/expire                      ``expire_leases``
POST      /rollouts/wait                      ``wait_for_rollouts``, long-poll (capped)
POST      /llm_calls                          ``add_llm_calls``
POST      /spans                              ``add_spans``
POST      /rewards                            ``add_rewards``
GET       /rollouts/{rollout_id}              ``get_rollout``
POST      /rollouts/query                     ``query_rollouts``
POST      /rollouts/browse                    ``browse_rollouts`` (a page, sorted, counted)
GET       /runs/{run_id}/rollout_counts       ``rollout_counts``
GET       /rollouts/{rollout_id}/attempts     ``get_attempts``
GET       /rollouts/{rollout_id}/llm_calls    ``get_llm_calls`` (``?attempt_id=``)
GET       /rollouts/{rollout_id}/spans        ``get_spans`` (``?attempt_id=``)
GET       /rollouts/{rollout_id}/rewards      ``get_rewards`` (``?attempt_id=``)
========  ==================================  ==========================================

Errors are JSON ``{"error": {"type": ..., "message": ...}}``: ``NotFoundError`` 404,
``StaleAttemptError`` 409, other store errors 400, bad bodies 422, missing or wrong token 401,
a body over the size limit 413, a ``Host`` that is not a loopback name on a server bound to
loopback 421 (:mod:`voltrl._http.hosts`), anything unexpected 500 (logged here with its
traceback; the answer carries only the message).

Writes (every POST but ``/rollouts/query``, ``/rollouts/wait`` and ``/v1/traces``) honour an
``X-Request-Id`` header: the first request with an id runs, later ones with the same id get its
answer (waiting for it when it is still running), so clients can retry writes without applying
them twice.

:func:`store_app` also serves the OTLP route at the root, ``/v1/traces``, where OpenTelemetry
SDKs send traces when given the server's URL as their OTLP endpoint.

The routes are FastAPI routes whose requests skip FastAPI's dependency machinery, and
``store_app`` sends requests for them straight to them (see :mod:`voltrl.store.http.routes`). The
routes a runner calls for every rollout (claim, enqueue, complete) are declared first.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import TypeAdapter
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp

from voltrl._http.auth import BearerAuth
from voltrl.resources import Resources
from voltrl.store.base import Store
from voltrl.store.browse import RolloutCount, RolloutPage, RolloutQuery
from voltrl.store.http.client import (
    _ATTEMPTS,
    _CLAIM,
    _COUNTS,
    _EXPIRE,
    _HEARTBEAT,
    _LLM_CALLS,
    _MAYBE_CLAIM,
    _MAYBE_RESOURCES,
    _NONE,
    _PAGE,
    _RESOURCES,
    _REWARDS,
    _ROLLOUT,
    _ROLLOUTS,
    _RUN,
    _RUNS,
    _SPANS,
    API_PREFIX,
    REQUEST_ID_HEADER,
    ClaimRequest,
    EnqueueRequest,
    ErrorResponse,
    ExpireResponse,
    HealthResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    LLMCallsRequest,
    QueryRequest,
    RewardsRequest,
    SpansRequest,
    StartRolloutRequest,
    WaitRequest,
)
from voltrl.store.http.otlp import OTLP_PATH, OTLP_REQUEST_BODY, export_traces
from voltrl.store.http.routes import (
    HEALTH_PATH,
    StoreApp,
    error_parts,
    http_exception,
    route_class,
)
from voltrl.store.http.routes import error_response as error_response
from voltrl.types import Attempt, AttemptResult, Claim, LLMCall, Reward, Rollout, Run, Span

UI_PATH = "/ui"
"""Where ``voltrl serve`` mounts the dashboard."""
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest request body a store server accepts unless told otherwise."""

DEFAULT_MAX_WAIT_S = 30.0
"""Longest a long-poll request (claim, wait for rollouts) is held before it answers."""

DEFAULT_DEDUP_MAX_BYTES = 32 * 1024 * 1024
"""Bytes of remembered write answers (for retries with the same request id) kept at most."""

_JSON = "application/json"
_HEALTH = HealthResponse().model_dump_json().encode()


_ENTRY_OVERHEAD = 250
"""Bytes a remembered answer takes besides its key and body (objects, dict slot), counted
against ``dedup_max_bytes`` so that the budget bounds the memory really used."""


@dataclass(slots=True)
class _Replay:
    created: float
    task: asyncio.Future[tuple[int, bytes]] | None
    answer: tuple[int, bytes] | None = None
    size: int = 0


class _Replays:
    """Runs each write request id once and answers repeats with the first answer.

    A client that disconnects (or times out) does not cancel the operation half-way, and its
    retry picks up the same result: the operation runs to its end in the request that started
    it (uvicorn never cancels a request for a lost client), or, for operations abandoned on
    disconnect, as a task of its own. Answers of 5xx are forgotten so a retry runs again;
    others are kept ``ttl_s`` seconds (as bytes), the oldest dropped sooner when the kept
    answers pass ``max_bytes``.
    """

    def __init__(self, ttl_s: float, max_bytes: int) -> None:
        self._ttl_s = ttl_s
        self._max_bytes = max_bytes
        self._entries: OrderedDict[str, _Replay] = OrderedDict()
        self._bytes = 0

    async def run(
        self,
        request: Request,
        op: Callable[[], Awaitable[Any]],
        adapter: TypeAdapter[Any],
        *,
        abandon_on_disconnect: bool = False,
    ) -> Response:
        """Answer ``request`` with ``op()`` serialised by ``adapter``, once per request id.

        ``abandon_on_disconnect``: cancel ``op`` if the client goes away before it finishes.
        Only for operations that change nothing until their last step, such as a long-poll
        claim: a dead worker's pending claim must not take a rollout nobody will run.
        """
        request_id = request.headers.get(REQUEST_ID_HEADER)
        if request_id is None and not abandon_on_disconnect:
            return Response(adapter.dump_json(await op()), media_type=_JSON)
        if request_id is None:
            once = asyncio.ensure_future(self._outcome(op, adapter))
            if not await _finished_before_disconnect(request, once):
                once.cancel()
                return Response(status_code=499)
            status, body = once.result()
            return Response(body, status_code=status, media_type=_JSON)
        key = f"{request.scope['path']} {request_id}"
        replay = self._entries.get(key)
        if replay is not None and replay.answer is not None:
            status, body = replay.answer
        elif replay is not None or abandon_on_disconnect:
            if replay is None:
                self._evict()
                task = asyncio.ensure_future(self._outcome(op, adapter))
                replay = self._entries[key] = _Replay(time.monotonic(), task)
                task.add_done_callback(lambda _: self._settle(key, replay))
            pending = replay.task
            assert pending is not None
            if abandon_on_disconnect and not await _finished_before_disconnect(request, pending):
                pending.cancel()
                return Response(status_code=499)
            status, body = await asyncio.shield(pending)
        else:
            # The first request with this id runs the operation itself (no task of its own:
            # it is cheaper, and uvicorn does not cancel a request whose client went away);
            # repeats that arrive meanwhile wait for its answer.
            self._evict()
            answer = asyncio.get_running_loop().create_future()
            replay = self._entries[key] = _Replay(time.monotonic(), answer)
            try:
                status, body = await self._outcome(op, adapter)
            except BaseException:
                answer.cancel()
                self._settle(key, replay)
                raise
            answer.set_result((status, body))
            self._settle(key, replay)
        return Response(body, status_code=status, media_type=_JSON)

    @staticmethod
    async def _outcome(
        op: Callable[[], Awaitable[Any]], adapter: TypeAdapter[Any]
    ) -> tuple[int, bytes]:
        try:
            return 200, adapter.dump_json(await op())
        except Exception as exc:
            status, body, _ = error_parts(exc)
            return status, body

    def _settle(self, key: str, replay: _Replay) -> None:
        task, replay.task = replay.task, None
        if self._entries.get(key) is not replay:
            return
        if task is None or task.cancelled() or task.result()[0] >= 500:
            del self._entries[key]
        else:
            replay.answer = task.result()
            replay.size = len(key) + len(replay.answer[1]) + _ENTRY_OVERHEAD
            self._bytes += replay.size

    def _evict(self) -> None:
        """Forget the oldest finished answers while they are expired or over the budget."""
        expired = time.monotonic() - self._ttl_s
        doomed = []
        for key, replay in self._entries.items():
            if replay.created > expired and self._bytes <= self._max_bytes:
                break
            if replay.answer is not None:
                doomed.append(key)
                self._bytes -= replay.size
        for key in doomed:
            del self._entries[key]


async def _finished_before_disconnect(request: Request, task: asyncio.Future[Any]) -> bool:
    """Wait for ``task``; False if the client disconnected first."""
    # One turn of the loop lets the task run its first step: a claim that finds a queued
    # rollout at once is done by then and needs no watcher.
    await asyncio.sleep(0)
    if task.done():
        return True

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({watcher, task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    return task.done()


def _ok(adapter: TypeAdapter[Any], value: Any) -> Response:
    return Response(adapter.dump_json(value), media_type=_JSON)


_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 413, 422, 500)
}
_MISSING = {404: {"model": ErrorResponse}}
_STALE = {409: {"model": ErrorResponse}}


def store_router(
    store: Store,
    *,
    max_wait_s: float = DEFAULT_MAX_WAIT_S,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    dedup_ttl_s: float = 300.0,
    dedup_max_bytes: int = DEFAULT_DEDUP_MAX_BYTES,
) -> APIRouter:
    """The store routes (see the module docstring), to include under ``/v1/store``; an app
    that includes them checks a token by wrapping itself in
    :class:`~voltrl._http.auth.BearerAuth`.

    ``max_wait_s``: cap on how long a long-poll request is held. ``max_body_bytes``: larger
    request bodies get 413. ``dedup_ttl_s``, ``dedup_max_bytes``: how long, and up to how many
    bytes in all, the answers of writes are kept for retries with the same ``X-Request-Id``.
    """
    if max_wait_s <= 0 or max_body_bytes <= 0:
        raise ValueError("max_wait_s and max_body_bytes must be positive")
    router = APIRouter(route_class=route_class(max_body_bytes), responses=_ERRORS)
    replays = _Replays(dedup_ttl_s, dedup_max_bytes)

    def capped(wait_s: float | None) -> float:
        return max_wait_s if wait_s is None else min(max(wait_s, 0.0), max_wait_s)

    # ---- what a runner calls for every rollout: matched first ---------------------------
    @router.post("/claims", response_model=Claim | None)
    async def claim(body: ClaimRequest, request: Request) -> Response:
        """Claim the oldest queued rollout, waiting up to ``wait_s`` (capped); null if none."""
        wait_s = capped(body.wait_s)
        return await replays.run(
            request,
            lambda: store.claim(body.worker_id, lease_s=body.lease_s, wait_s=wait_s),
            _MAYBE_CLAIM,
            abandon_on_disconnect=True,
        )

    @router.post("/rollouts", response_model=list[Rollout])
    async def enqueue(body: EnqueueRequest, request: Request) -> Response:
        """Queue one rollout per task."""

        def op() -> Awaitable[list[Rollout]]:
            return store.enqueue(
                body.tasks,
                mode=body.mode,
                run_id=body.run_id,
                resources_version=body.resources_version,
                max_attempts=body.max_attempts,
                timeout_s=body.timeout_s,
                retry_agent_errors=body.retry_agent_errors,
            )

        return await replays.run(request, op, _ROLLOUTS)

    @router.post("/rollouts/started", response_model=Claim)
    async def start_rollout(body: StartRolloutRequest, request: Request) -> Response:
        """Record a rollout its caller runs itself, running with one attempt (never queued)."""

        def op() -> Awaitable[Claim]:
            return store.start_rollout(
                body.task,
                worker_id=body.worker_id,
                mode=body.mode,
                run_id=body.run_id,
                resources_version=body.resources_version,
                lease_s=body.lease_s,
            )

        return await replays.run(request, op, _CLAIM)

    @router.post("/attempts/{attempt_id}/complete", response_model=Rollout, responses=_STALE)
    async def complete(attempt_id: str, result: AttemptResult, request: Request) -> Response:
        """Finish an attempt with its whole report (409 if it no longer owns its rollout)."""
        return await replays.run(request, lambda: store.complete(attempt_id, result), _ROLLOUT)

    @router.post("/heartbeats", response_model=HeartbeatResponse)
    async def heartbeat(body: HeartbeatRequest, request: Request) -> Response:
        """Renew leases; answers the attempts that no longer own their rollout."""

        async def op() -> HeartbeatResponse:
            return HeartbeatResponse(
                stale=await store.heartbeat(body.attempt_ids, lease_s=body.lease_s)
            )

        return await replays.run(request, op, _HEARTBEAT)

    @router.get("/resources", response_model=Resources | None)
    async def get_resources(version: int | None = None) -> Response:
        """One resources version, or the latest; null when there is none."""
        return _ok(_MAYBE_RESOURCES, await store.get_resources(version))

    # ---- records ----------------------------------------------------------------------
    @router.post("/llm_calls", response_model=list[LLMCall], responses=_MISSING)
    async def add_llm_calls(body: LLMCallsRequest, request: Request) -> Response:
        """Record LLM calls; answers them with sequence ids assigned."""
        return await replays.run(request, lambda: store.add_llm_calls(body.calls), _LLM_CALLS)

    @router.post("/spans", response_model=list[Span], responses=_MISSING)
    async def add_spans(body: SpansRequest, request: Request) -> Response:
        """Record spans; answers them with sequence ids assigned."""
        return await replays.run(request, lambda: store.add_spans(body.spans), _SPANS)

    @router.post("/rewards", response_model=None, responses=_MISSING)
    async def add_rewards(body: RewardsRequest, request: Request) -> Response:
        """Record rewards; answers null."""
        return await replays.run(request, lambda: store.add_rewards(body.rewards), _NONE)

    # ---- runs and resources -----------------------------------------------------------
    @router.get("/health", response_model=HealthResponse, tags=["store"])
    async def health() -> Response:
        """Whether the server is up; needs no token."""
        return Response(_HEALTH, media_type=_JSON)

    @router.post("/runs", response_model=Run)
    async def add_run(run: Run, request: Request) -> Response:
        """Record a run."""
        return await replays.run(request, lambda: store.add_run(run), _RUN)

    @router.get("/runs", response_model=list[Run])
    async def list_runs() -> Response:
        """All runs, oldest first."""
        return _ok(_RUNS, await store.list_runs())

    @router.post("/resources", response_model=Resources)
    async def add_resources(resources: Resources, request: Request) -> Response:
        """Save a new resources version."""
        return await replays.run(request, lambda: store.add_resources(resources), _RESOURCES)

    # ---- queue ------------------------------------------------------------------------
    @router.post("/rollouts/{rollout_id}/cancel", response_model=Rollout, responses=_MISSING)
    async def cancel(rollout_id: str, request: Request) -> Response:
        """Cancel a rollout that has not finished."""
        return await replays.run(request, lambda: store.cancel(rollout_id), _ROLLOUT)

    @router.post("/leases/expire", response_model=ExpireResponse)
    async def expire_leases(request: Request) -> Response:
        """End attempts whose lease ran out."""

        async def op() -> ExpireResponse:
            return ExpireResponse(expired=await store.expire_leases())

        return await replays.run(request, op, _EXPIRE)

    @router.post("/rollouts/wait", response_model=list[Rollout], responses=_MISSING)
    async def wait_for_rollouts(body: WaitRequest) -> Response:
        """Wait (capped) until the rollouts finish; answers the finished ones, in order."""
        done = await store.wait_for_rollouts(body.rollout_ids, timeout_s=capped(body.timeout_s))
        return _ok(_ROLLOUTS, done)

    # ---- queries ----------------------------------------------------------------------
    @router.get("/rollouts/{rollout_id}", response_model=Rollout, responses=_MISSING)
    async def get_rollout(rollout_id: str) -> Response:
        """One rollout."""
        return _ok(_ROLLOUT, await store.get_rollout(rollout_id))

    @router.post("/rollouts/query", response_model=list[Rollout])
    async def query_rollouts(body: QueryRequest) -> Response:
        """Rollouts matching every given filter, oldest first."""
        found = await store.query_rollouts(
            run_id=body.run_id,
            status=body.status,
            mode=body.mode,
            since=body.since,
            until=body.until,
            rollout_ids=body.rollout_ids,
            limit=body.limit,
        )
        return _ok(_ROLLOUTS, found)

    @router.post("/rollouts/browse", response_model=RolloutPage)
    async def browse_rollouts(body: RolloutQuery) -> Response:
        """One page of the rollouts matching the query, sorted, and how many matched."""
        return _ok(_PAGE, await store.browse_rollouts(body))

    @router.get("/runs/{run_id}/rollout_counts", response_model=list[RolloutCount])
    async def rollout_counts(run_id: str) -> Response:
        """A run's rollouts counted by mode, resources version and status, with rewards."""
        return _ok(_COUNTS, await store.rollout_counts(run_id))

    @router.get("/rollouts/{rollout_id}/attempts", response_model=list[Attempt], responses=_MISSING)
    async def get_attempts(rollout_id: str) -> Response:
        """A rollout's attempts, first to last."""
        return _ok(_ATTEMPTS, await store.get_attempts(rollout_id))

    @router.get(
        "/rollouts/{rollout_id}/llm_calls", response_model=list[LLMCall], responses=_MISSING
    )
    async def get_llm_calls(rollout_id: str, attempt_id: str | None = None) -> Response:
        """A rollout's LLM calls (of one attempt when given), by sequence id."""
        return _ok(_LLM_CALLS, await store.get_llm_calls(rollout_id, attempt_id))

    @router.get("/rollouts/{rollout_id}/spans", response_model=list[Span], responses=_MISSING)
    async def get_spans(rollout_id: str, attempt_id: str | None = None) -> Response:
        """A rollout's spans (of one attempt when given), by sequence id."""
        return _ok(_SPANS, await store.get_spans(rollout_id, attempt_id))

    @router.get("/rollouts/{rollout_id}/rewards", response_model=list[Reward], responses=_MISSING)
    async def get_rewards(rollout_id: str, attempt_id: str | None = None) -> Response:
        """A rollout's rewards (of one attempt when given), oldest first."""
        return _ok(_REWARDS, await store.get_rewards(rollout_id, attempt_id))

    _add_otlp_route(router, store, max_body_bytes)
    return router


def store_app(
    store: Store,
    *,
    token: str | None = None,
    root: ASGIApp | None = None,
    ui: ASGIApp | None = None,
    max_wait_s: float = DEFAULT_MAX_WAIT_S,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    dedup_ttl_s: float = 300.0,
    dedup_max_bytes: int = DEFAULT_DEDUP_MAX_BYTES,
) -> ASGIApp:
    """The app serving ``store`` under ``/v1/store`` (options as :func:`store_router`), its
    OTLP trace route at ``/v1/traces``, its OpenAPI spec at ``/openapi.json`` and, when given,
    ``root`` (such as the gateway) on every other path. There is no docs page: FastAPI's loads
    Swagger UI from a CDN, blank offline; any OpenAPI viewer reads the spec.

    With a ``token``, the whole app is wrapped in :class:`~voltrl._http.auth.BearerAuth`:
    every route but ``/v1/store/health`` needs it. Without one, the app is a FastAPI app.
    Unknown paths and methods, and anything unexpected in ``root``, also answer in the JSON
    error format. ``ui`` (the dashboard) is served under ``/ui``; with a token it does its
    own sign-in (a browser sends no bearer header): the same token buys a session cookie
    for ``/ui/`` only. Served on loopback, the app answers only requests for loopback names
    (:func:`~voltrl._http.serving.serve` adds the Host check).
    """
    app = StoreApp(title="VoltRL store", version="1", docs_url=None, redoc_url=None)
    router = store_router(
        store,
        max_wait_s=max_wait_s,
        max_body_bytes=max_body_bytes,
        dedup_ttl_s=dedup_ttl_s,
        dedup_max_bytes=dedup_max_bytes,
    )
    otlp = otlp_router(store, max_body_bytes=max_body_bytes)
    app.include_router(router, prefix=API_PREFIX)
    app.include_router(otlp)
    app.add_exception_handler(HTTPException, http_exception)
    app.add_exception_handler(Exception, http_exception)
    if ui is not None:
        app.mount(UI_PATH, ui)
    if root is not None:
        app.mount("/", root)
    app.index_routes(API_PREFIX, router)
    app.index_routes("", otlp)
    if not token:
        return app
    if ui is None:
        return BearerAuth(app, token, (HEALTH_PATH,))
    return BearerAuth(app, token, (HEALTH_PATH, UI_PATH), open_prefixes=(f"{UI_PATH}/",))


def otlp_router(store: Store, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> APIRouter:
    """Only the OTLP trace route, ``/v1/traces``, to include at an app's root (where
    OpenTelemetry SDKs send traces when given the server's URL as their OTLP endpoint)."""
    router = APIRouter(route_class=route_class(max_body_bytes))
    _add_otlp_route(router, store, max_body_bytes)
    return router


def _add_otlp_route(router: APIRouter, store: Store, max_body_bytes: int) -> None:
    @router.post(
        OTLP_PATH,
        response_model=None,
        openapi_extra=OTLP_REQUEST_BODY,
        tags=["otlp"],
        responses={status: {"model": ErrorResponse} for status in (400, 401, 413, 415)},
    )
    async def otlp_traces(request: Request) -> Response:
        """OTLP/HTTP trace export (protobuf or JSON): spans and rewards of rollouts."""
        return await export_traces(store, request, max_bytes=max_body_bytes)
