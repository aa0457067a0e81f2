"""The store over HTTP: auth, error mapping, limits, long-polls and retries.

Store semantics over HTTP are covered by ``tests/store/test_store.py`` (the ``http`` store kind);
these tests are about what HTTP adds. Servers are real uvicorn servers on loopback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.types import Message, Receive, Scope, Send

from voltrl._http.auth import BearerAuth
from voltrl._http.serving import BackgroundServer, serve, serve_in_thread
from voltrl.errors import NotFoundError, StaleAttemptError, StoreError
from voltrl.store.http.client import API_PREFIX, REQUEST_ID_HEADER, HTTPStore
from voltrl.store.http.endpoints import store_app, store_router
from voltrl.store.http.routes import HEALTH_PATH
from voltrl.store.memory import InMemoryStore
from voltrl.types import AttemptResult, Run, Task

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WAKE_LIMIT_S = 10.0  # far longer than any wake-up takes; reaching it means no wake-up came


def tasks(n: int) -> list[Task]:
    return [Task(input={"i": i}, index=i) for i in range(n)]


async def until_waiting(store: InMemoryStore, n: int) -> None:
    """Poll until ``n`` long-polls wait on ``store`` for a change (a claim that found nothing
    queued sleeps as one of its notifier's waiters)."""
    try:
        async with asyncio.timeout(WAKE_LIMIT_S):
            while len(store._changed._waiters) != n:
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"{len(store._changed._waiters)} long-polls wait, not {n}") from None


class Served:
    """Servers and clients made by a test, all stopped and closed at teardown."""

    def __init__(self) -> None:
        self.servers: list[BackgroundServer] = []
        self.clients: list[HTTPStore] = []

    def server(
        self, store: InMemoryStore | None = None, *, port: int = 0, app: Any = None, **opts: Any
    ) -> tuple[BackgroundServer, InMemoryStore]:
        store = InMemoryStore() if store is None else store
        app = store_app(store, token=TOKEN, **opts) if app is None else app
        server = serve_in_thread(app, port=port)
        self.servers.append(server)
        return server, store

    def client(self, url: str, token: str | None = TOKEN, **opts: Any) -> HTTPStore:
        client = HTTPStore(url, token, **opts)
        self.clients.append(client)
        return client


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    s = Served()
    yield s
    for client in s.clients:
        await client.close()
    for server in s.servers:
        await asyncio.to_thread(server.stop)


def error_of(response: httpx.Response) -> dict[str, str]:
    """The ``{"type", "message"}`` of a JSON error answer (fails on anything else)."""
    assert response.headers["content-type"] == "application/json"
    assert "Traceback" not in response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message"}
    return body["error"]


# ---- auth -----------------------------------------------------------------------------------
async def test_health_is_open_and_every_other_route_needs_the_token(served: Served) -> None:
    server, _ = served.server()
    async with httpx.AsyncClient(base_url=server.url + API_PREFIX) as http:
        assert (await http.get("/health")).json() == {"status": "ok"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            r = await http.get("/runs", headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert error_of(r)["type"] == "Unauthorized"
            r = await http.post("/rollouts", json={"tasks": []}, headers=headers)
            assert r.status_code == 401
        assert (await http.get("/runs", headers=AUTH)).json() == []

    with pytest.raises(StoreError, match="401"):
        await served.client(server.url, token="wrong").list_runs()
    with pytest.raises(StoreError, match="401"):
        await served.client(server.url, token=None).enqueue(tasks(1))


async def test_server_without_token_needs_none(served: Served) -> None:
    store = InMemoryStore()
    server, _ = served.server(app=store_app(store))
    [r] = await served.client(server.url, token=None).enqueue(tasks(1))
    assert (await store.get_rollout(r.rollout_id)).status == "queued"


# ---- errors ---------------------------------------------------------------------------------
async def test_errors_come_back_as_the_same_typed_exceptions(served: Served) -> None:
    server, _ = served.server()
    store = served.client(server.url)
    with pytest.raises(NotFoundError, match="no rollout with id 'ro-missing'"):
        await store.get_rollout("ro-missing")
    with pytest.raises(NotFoundError):
        await store.get_attempts("ro-missing")
    with pytest.raises(NotFoundError):
        await store.wait_for_rollouts(["ro-missing"], timeout_s=0)
    with pytest.raises(StaleAttemptError):
        await store.complete("at-missing", AttemptResult(status="succeeded"))
    await store.enqueue(tasks(1))
    c = await store.claim("w")
    assert c is not None
    await store.complete(c.attempt.attempt_id, AttemptResult(status="succeeded", reward=1.0))
    with pytest.raises(StaleAttemptError, match="no longer owns it"):
        await store.complete(c.attempt.attempt_id, AttemptResult(status="succeeded"))

    async with httpx.AsyncClient(base_url=server.url + API_PREFIX, headers=AUTH) as http:
        r = await http.get("/rollouts/ro-missing")
        assert r.status_code == 404 and error_of(r)["type"] == "NotFoundError"
        r = await http.post(f"/attempts/{c.attempt.attempt_id}/complete", json={"status": "failed"})
        assert r.status_code == 409 and error_of(r)["type"] == "StaleAttemptError"
        r = await http.get("/no/such/route")
        assert r.status_code == 404 and error_of(r)["type"] == "NotFound"
        r = await http.delete("/runs")
        assert r.status_code == 405 and error_of(r)


async def test_malformed_requests_get_a_json_4xx_not_a_traceback(served: Served) -> None:
    server, store = served.server()
    async with httpx.AsyncClient(base_url=server.url + API_PREFIX, headers=AUTH) as http:
        json_headers = {"content-type": "application/json"}
        bad = [
            http.post("/rollouts", content=b"{not json", headers=json_headers),
            http.post("/rollouts", content=b"[1, 2]", headers=json_headers),
            http.post("/rollouts", json={"tasks": [{"inputs": {}}]}),
            http.post("/claims", json={"worker_id": "w", "lease_s": "long"}),
            http.post("/attempts/at-x/complete", json={"status": "great"}),
            http.post("/rewards", json={"rewards": [{"rollout_id": "r", "attempt_id": "a"}]}),
            http.get("/resources", params={"version": "latest"}),
        ]
        for request in bad:
            r = await request
            assert r.status_code == 422, r.text
            assert error_of(r)["type"] == "ValidationError"
        r = await http.post("/rollouts", json={"tasks": [{"inputs": {}}]})
        assert "tasks.0.input: Field required" in error_of(r)["message"]
    assert await store.query_rollouts() == []


class BrokenStore(InMemoryStore):
    """A store with a bug: listing runs fails unexpectedly."""

    async def list_runs(self) -> list[Run]:
        raise RuntimeError("disk on fire")


async def test_unexpected_error_is_a_500_with_a_message_and_the_client_raises(
    served: Served,
) -> None:
    server, _ = served.server(BrokenStore())
    async with httpx.AsyncClient(base_url=server.url + API_PREFIX, headers=AUTH) as http:
        r = await http.get("/runs")
    assert r.status_code == 500
    assert error_of(r) == {
        "type": "InternalError",
        "message": "unexpected RuntimeError: disk on fire",
    }
    client = served.client(server.url, retries=1, backoff_s=0.001)
    with pytest.raises(
        StoreError, match="500 InternalError: unexpected RuntimeError: disk on fire"
    ):
        await client.list_runs()


async def test_unreachable_server_raises_store_error_never_empty(served: Served) -> None:
    server, _ = served.server()
    url = server.url
    server.stop()
    with pytest.raises(StoreError, match="unreachable"):
        await served.client(url, retries=1, backoff_s=0.001).list_runs()


# ---- body size ------------------------------------------------------------------------------
async def test_oversized_body_gets_413_and_nothing_is_applied(served: Served) -> None:
    server, store = served.server(max_body_bytes=4096)
    big = {"tasks": [{"input": {"text": "x" * 10_000}}]}
    async with httpx.AsyncClient(base_url=server.url + API_PREFIX, headers=AUTH) as http:
        r = await http.post("/rollouts", json=big)
        assert r.status_code == 413 and "over the limit of 4096 bytes" in error_of(r)["message"]

        async def chunks() -> AsyncIterator[bytes]:  # no content-length: counted as it arrives
            yield b'{"tasks": [{"input": {"text": "'
            for _ in range(10):
                yield b"x" * 1000
            yield b'"}}]}'

        r = await http.post(
            "/rollouts", content=chunks(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413 and error_of(r)["type"] == "PayloadTooLarge"
        assert (await http.post("/rollouts", json={"tasks": [{"input": {}}]})).status_code == 200

    client = served.client(server.url)
    with pytest.raises(StoreError, match="413"):
        await client.enqueue([Task(input={"text": "x" * 10_000})])
    assert len(await store.query_rollouts()) == 1


# ---- long-polls -----------------------------------------------------------------------------
@pytest.mark.parametrize("max_wait_s", [30.0, 0.05])
async def test_long_poll_claim_wakes_on_enqueue_from_another_client(
    served: Served, max_wait_s: float
) -> None:
    """With a short server cap the client keeps polling until its own wait is over."""
    server, _ = served.server(max_wait_s=max_wait_s)
    worker, producer = served.client(server.url), served.client(server.url)
    waiter = asyncio.create_task(worker.claim("w", wait_s=60.0))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    [r] = await producer.enqueue(tasks(1))
    c = await asyncio.wait_for(waiter, WAKE_LIMIT_S)
    assert c is not None and c.rollout.rollout_id == r.rollout_id


async def test_long_poll_claim_returns_none_when_its_wait_ends(served: Served) -> None:
    server, _ = served.server(max_wait_s=0.05)
    assert await served.client(server.url).claim("w", wait_s=0.2) is None


async def test_wait_for_rollouts_spans_several_capped_long_polls(served: Served) -> None:
    server, _ = served.server(max_wait_s=0.05)
    algorithm, worker = served.client(server.url), served.client(server.url)
    rollouts = await algorithm.enqueue(tasks(2))
    waiter = asyncio.create_task(algorithm.wait_for_rollouts([r.rollout_id for r in rollouts]))
    for _ in rollouts:
        c = await worker.claim("w")
        assert c is not None
        await asyncio.sleep(0.1)
        await worker.complete(c.attempt.attempt_id, AttemptResult(status="succeeded"))
    done = await asyncio.wait_for(waiter, WAKE_LIMIT_S)
    assert [r.rollout_id for r in done] == [r.rollout_id for r in rollouts]
    assert all(r.status == "succeeded" for r in done)


# ---- retries and request ids ----------------------------------------------------------------
async def test_writes_with_the_same_request_id_apply_once(served: Served) -> None:
    server, store = served.server()
    async with httpx.AsyncClient(base_url=server.url + API_PREFIX, headers=AUTH) as http:
        once = {**AUTH, REQUEST_ID_HEADER: "req-1"}
        first = await http.post("/rollouts", json={"tasks": [{"input": {}}]}, headers=once)
        again = await http.post("/rollouts", json={"tasks": [{"input": {}}]}, headers=once)
        assert first.status_code == again.status_code == 200 and first.json() == again.json()
        assert len(await store.query_rollouts()) == 1

        # the queued rollout is claimed once, however often the request is repeated
        claim = {"worker_id": "w", "wait_s": 0.0}
        a, b = await asyncio.gather(
            *(http.post("/claims", json=claim, headers={REQUEST_ID_HEADER: "c1"}) for _ in "ab")
        )
        assert a.json() is not None and a.json() == b.json()

        # a repeat of a long-poll that is still waiting joins it
        claim = {"worker_id": "w", "wait_s": 30.0}
        waiters = [
            asyncio.create_task(http.post("/claims", json=claim, headers={REQUEST_ID_HEADER: "c2"}))
            for _ in "ab"
        ]
        await asyncio.sleep(0.2)
        assert not any(w.done() for w in waiters)
        [r] = (await http.post("/rollouts", json={"tasks": [{"input": {}}]})).json()
        a, b = await asyncio.wait_for(asyncio.gather(*waiters), WAKE_LIMIT_S)
        assert a.json() == b.json() and a.json()["rollout"]["rollout_id"] == r["rollout_id"]
    assert [r.attempt_count for r in await store.query_rollouts()] == [1, 1]


def lose_first_response(app: Any, path_suffix: str) -> Any:
    """``app``, except that the first request to a path ending in ``path_suffix`` runs but its
    answer is lost (the server fails after the work is done, as a dropped connection would)."""
    lost: list[str] = []

    async def wrapper(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].endswith(path_suffix) and not lost:
            lost.append(scope["path"])

            async def discard(message: Message) -> None:
                pass

            await app(scope, receive, discard)
            raise RuntimeError("answer lost")
        await app(scope, receive, send)

    return wrapper


async def test_retried_claim_after_a_lost_answer_claims_once(served: Served) -> None:
    store = InMemoryStore()
    app = lose_first_response(store_app(store, token=TOKEN), "/claims")
    server, _ = served.server(store, app=app)
    client = served.client(server.url, backoff_s=0.001)
    [r] = await client.enqueue(tasks(1))
    c = await client.claim("w")
    assert c is not None and c.rollout.rollout_id == r.rollout_id
    attempts = await client.get_attempts(r.rollout_id)
    assert [a.attempt_id for a in attempts] == [c.attempt.attempt_id]


async def test_retried_complete_after_a_lost_answer_is_not_stale(served: Served) -> None:
    store = InMemoryStore()
    server, _ = served.server(
        store, app=lose_first_response(store_app(store, token=TOKEN), "/complete")
    )
    client = served.client(server.url, backoff_s=0.001)
    await client.enqueue(tasks(1))
    c = await client.claim("w")
    assert c is not None
    done = await client.complete(c.attempt.attempt_id, AttemptResult(status="succeeded", reward=2))
    assert done.status == "succeeded" and done.reward == 2


class RetryLogged(logging.Handler):
    """Sets an event when the HTTP store client logs that it will retry a request."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "retry" in record.getMessage():
            self.loop.call_soon_threadsafe(self.event.set)


async def test_retry_reaches_a_server_restarted_on_the_same_port_without_duplicates(
    served: Served,
) -> None:
    server, store = served.server()
    client = served.client(server.url, retries=200, backoff_s=0.02, max_backoff_s=0.1)
    await client.enqueue(tasks(1))  # a pooled connection to the first server
    await asyncio.to_thread(server.stop)

    retries = RetryLogged()
    logger = logging.getLogger("voltrl.store.http.client")
    logger.addHandler(retries)
    try:
        write = asyncio.create_task(client.enqueue(tasks(3)))
        await asyncio.wait_for(retries.event.wait(), WAKE_LIMIT_S)
        assert not write.done()
        restarted, _ = await asyncio.to_thread(served.server, store, port=server.port)
        assert restarted.url == server.url
        await asyncio.wait_for(write, WAKE_LIMIT_S)
    finally:
        logger.removeHandler(retries)
    assert len(await client.query_rollouts()) == 4
    c = await client.claim("w")
    assert c is not None and c.rollout.task.index == 0


# ---- event loops, mounting, serving -----------------------------------------------------------
def test_client_works_across_event_loops(served: Served) -> None:
    """Worker processes may call ``asyncio.run`` more than once with the same client."""
    server, store = served.server()
    client = HTTPStore(server.url, TOKEN)
    for _ in range(2):
        assert len(asyncio.run(client.enqueue(tasks(1)))) == 1
    asyncio.run(client.close())
    assert len(asyncio.run(store.query_rollouts())) == 2


async def test_store_router_mounts_next_to_other_routes(served: Served) -> None:
    store = InMemoryStore()
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, list[str]]:
        return {"data": []}

    app.include_router(store_router(store, max_body_bytes=1024), prefix=API_PREFIX)
    server, _ = served.server(store, app=BearerAuth(app, TOKEN, (HEALTH_PATH,)))
    client = served.client(server.url)
    await client.enqueue(tasks(1))
    with pytest.raises(NotFoundError):
        await client.get_rollout("ro-missing")
    async with httpx.AsyncClient(base_url=server.url) as http:
        assert (await http.get("/v1/models", headers=AUTH)).json() == {"data": []}
        r = await http.get(f"{API_PREFIX}/runs")
        assert r.status_code == 401 and error_of(r)["type"] == "Unauthorized"
        r = await http.post(f"{API_PREFIX}/rollouts", json={"x": "y" * 2000}, headers=AUTH)
        assert r.status_code == 413 and error_of(r)


async def test_serve_runs_on_the_current_event_loop() -> None:
    """The trainer serves a store that its own loop also uses: same loop, no thread."""
    store = InMemoryStore()
    url, stop = await serve(store_app(store, token=TOKEN))
    client = HTTPStore(url, TOKEN)
    try:
        waiter = asyncio.create_task(client.claim("w", wait_s=60.0))
        await until_waiting(store, 1)  # the claim waits on the server
        [r] = await store.enqueue(tasks(1))  # directly, as the algorithm does
        c = await asyncio.wait_for(waiter, WAKE_LIMIT_S)
        assert c is not None and c.rollout.rollout_id == r.rollout_id
    finally:
        await client.close()
        await stop()
    with pytest.raises(StoreError, match="unreachable"):
        await HTTPStore(url, TOKEN, retries=0).list_runs()


async def test_remembered_answers_are_bounded_in_bytes(served: Served) -> None:
    """Past the byte budget the oldest answers are forgotten (and a repeat runs again)."""
    for budget, expected in ((64 * 1024 * 1024, 2), (1, 3)):
        server, store = served.server(dedup_max_bytes=budget)
        async with httpx.AsyncClient(base_url=server.url + API_PREFIX, headers=AUTH) as http:
            body = {"tasks": [{"input": {}}]}
            for request_id in ("a", "b", "a"):
                r = await http.post("/rollouts", json=body, headers={REQUEST_ID_HEADER: request_id})
                assert r.status_code == 200
        assert len(await store.query_rollouts()) == expected


async def test_a_long_poll_claim_whose_client_died_takes_no_rollout(served: Served) -> None:
    server, store = served.server()
    client = served.client(server.url)
    body = b'{"worker_id": "dead", "lease_s": 30, "wait_s": 20}'
    _reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(
        b"POST /v1/store/claims HTTP/1.1\r\nContent-Type: application/json\r\n"
        + f"Host: {server.host}:{server.port}\r\nAuthorization: Bearer {TOKEN}\r\n".encode()
        + b"X-Request-Id: r1\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    await until_waiting(store, 1)  # the claim is now waiting on the server
    writer.close()  # the worker dies
    await writer.wait_closed()
    # The server saw the disconnect and dropped the claim: nothing else wakes it, so it only
    # stops waiting by being cancelled (its wait is 20 s, past the test's end).
    await until_waiting(store, 0)
    [queued] = await client.enqueue(tasks(1))
    claim = await client.claim("alive", wait_s=WAKE_LIMIT_S)
    assert claim is not None and claim.rollout.rollout_id == queued.rollout_id
    assert claim.attempt.index == 1  # no orphaned attempt was started before it


# ---- client transport -------------------------------------------------------------------------
def record_clients(app: Any, seen: list[tuple[str, int]]) -> Any:
    """``app``, recording the client address (host, port) of every request."""

    async def wrapper(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            seen.append(scope["client"])
        await app(scope, receive, send)

    return wrapper


async def test_client_keeps_one_connection_alive_across_calls(served: Served) -> None:
    store, seen = InMemoryStore(), []
    server, _ = served.server(store, app=record_clients(store_app(store, token=TOKEN), seen))
    client = served.client(server.url)
    for _ in range(5):
        await client.enqueue(tasks(1))
        c = await client.claim("w")
        assert c is not None
        await client.complete(c.attempt.attempt_id, AttemptResult(status="succeeded"))
    assert len(seen) == 15 and len(set(seen)) == 1


def fail_first(
    app: Any, path_suffix: str, times: int, status: int, retry_after: str | None = None
) -> Any:
    """``app``, except that the first ``times`` requests to a path ending in ``path_suffix``
    get ``status`` (with ``Retry-After`` when given) without reaching it (a proxy in front of
    a restarting server)."""
    failed: list[str] = []
    headers = [] if retry_after is None else [(b"retry-after", retry_after.encode())]

    async def wrapper(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].endswith(path_suffix) and len(failed) < times:
            failed.append(scope["path"])
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": b"<html>try again</html>"})
            return
        await app(scope, receive, send)

    return wrapper


async def test_5xx_answers_are_retried_and_the_write_applies_once(served: Served) -> None:
    store = InMemoryStore()
    server, _ = served.server(
        store, app=fail_first(store_app(store, token=TOKEN), "/rollouts", 2, 503)
    )
    client = served.client(server.url, backoff_s=0.001)
    [r] = await client.enqueue(tasks(1))
    assert [x.rollout_id for x in await store.query_rollouts()] == [r.rollout_id]

    server, _ = served.server(
        store, app=fail_first(store_app(store, token=TOKEN), "/claims", 9, 502)
    )
    with pytest.raises(StoreError, match="502 to POST /claims without a VoltRL error body"):
        await served.client(server.url, retries=2, backoff_s=0.001).claim("w")


class _Pauses:
    """Stands in for ``asyncio`` in :mod:`voltrl.retry`: records each backoff pause asked
    for, and yields without waiting it out."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    async def sleep(self, delay: float) -> None:
        self.asked.append(delay)
        await asyncio.sleep(0)


async def test_a_429_is_retried_no_sooner_than_its_retry_after(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    import voltrl.retry

    pauses = _Pauses()
    monkeypatch.setattr(voltrl.retry, "asyncio", pauses)
    store = InMemoryStore()
    app = fail_first(store_app(store, token=TOKEN), "/rollouts", 1, 429, retry_after="0.3")
    server, _ = served.server(store, app=app)
    client = served.client(server.url, backoff_s=0.001, max_backoff_s=1.0)
    await client.enqueue(tasks(1))
    # One retry, after the pause the answer asked for (not the 1 ms backoff).
    [pause] = pauses.asked
    assert 0.3 <= pause <= 1.0
    assert len(await store.query_rollouts()) == 1


async def test_a_success_answer_that_is_not_the_routes_body_raises(served: Served) -> None:
    """A claim must never read a broken answer as "no rollout queued"."""
    store = InMemoryStore()
    server, _ = served.server(
        store, app=fail_first(store_app(store, token=TOKEN), "/claims", 1, 200)
    )
    with pytest.raises(StoreError, match="not what the route returns"):
        await served.client(server.url).claim("w")
