"""The gateway's parts on their own: attribution (URL and headers to rollout, attempt, agent),
the drain (pause, resume, close), the upstream (replica choice, what the backend is asked for).
``tests/gateway/test_gateway.py`` runs them together through real HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from voltrl.gateway.attribution import AttemptCheck, attribute, call_kind, target_of
from voltrl.gateway.drain import Drain
from voltrl.gateway.errors import GatewayHTTPError
from voltrl.gateway.records import Call
from voltrl.gateway.upstream import Upstream, backend_body
from voltrl.retry import Backoff
from voltrl.store.memory import InMemoryStore
from voltrl.types import Task


def scope(path: str, root_path: str = "") -> dict[str, Any]:
    return {"path": path, "raw_path": path.encode(), "root_path": root_path, "headers": []}


def call(**body: Any) -> Call:
    return Call("chat", "r", "a", "writer", body, False, False, False)


# ---- attribution ---------------------------------------------------------------------------
def test_a_scoped_url_under_a_mount_names_rollout_attempt_and_an_agent_with_a_slash() -> None:
    target = target_of(
        scope("/gw/rollouts/r%201/attempts/a1/agents/team%2Frole/v1/completions", "/gw")
    )
    assert (target.rollout_id, target.attempt_id, target.agent_name) == ("r 1", "a1", "team/role")
    assert target.endpoint == "/v1/completions" and call_kind(target, "POST") == "completions"
    assert attribute(target, {"x-agent-name": "other"}, "trace_id") == ("r 1", "a1", "team/role")


def test_the_header_form_takes_the_rollout_from_the_trace_header_and_leaves_the_attempt() -> None:
    target = target_of(scope("/v1/chat/completions/"))
    headers = {"trace_id": "r2", "x-agent-name": "judge"}
    assert attribute(target, headers, "trace_id") == ("r2", None, "judge")
    with pytest.raises(GatewayHTTPError, match="no rollout id") as info:
        attribute(target, {}, "trace_id")
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("path", "method", "status", "says"),
    [
        ("/rollouts/r/v1/chat/completions", "POST", 404, "no route"),
        ("/v1/responses", "POST", 404, "not the Responses API"),
        ("/v1/chat/completions", "GET", 405, "GET is not allowed"),
    ],
)
def test_urls_the_gateway_does_not_serve_are_refused_before_anything_is_read(
    path: str, method: str, status: int, says: str
) -> None:
    with pytest.raises(GatewayHTTPError, match=says) as info:
        call_kind(target_of(scope(path)), method)
    assert info.value.status == status


async def test_an_attempt_is_checked_once_and_a_missing_one_defaults_to_the_running_one() -> None:
    class CountingStore(InMemoryStore):
        asked = 0

        async def get_attempts(self, rollout_id: str) -> Any:
            self.asked += 1
            return await super().get_attempts(rollout_id)

    store = CountingStore()
    await store.enqueue([Task(input={})])
    claim = await store.claim("worker")
    assert claim is not None
    rid, running = claim.rollout.rollout_id, claim.attempt.attempt_id
    check = AttemptCheck(store)
    assert await check.resolve(rid, None) == running
    assert await check.resolve(rid, running) == running
    assert await check.resolve(rid, running) == running
    assert store.asked == 2  # the second check of the named attempt was remembered
    for rollout, attempt, says in [
        ("nope", None, "unknown rollout"),
        (rid, "x", "unknown attempt"),
    ]:
        with pytest.raises(GatewayHTTPError, match=says) as info:
            await check.resolve(rollout, attempt)
        assert info.value.status == 404


# ---- drain ---------------------------------------------------------------------------------
async def test_pause_waits_for_the_call_in_flight_and_holds_the_next_until_resume() -> None:
    drain = Drain(wait_s=30, retry_after_s=5)
    flight = await drain.admit()
    pausing = asyncio.ensure_future(drain.pause())
    await asyncio.sleep(0.01)
    assert drain.paused and not pausing.done()  # the call in flight has not left yet
    drain.leave(flight)
    await pausing
    held = asyncio.ensure_future(drain.admit())
    await asyncio.sleep(0.01)
    assert drain.waiting == 1 and drain.inflight == 0 and not held.done()
    drain.resume()
    await held
    assert drain.waiting == 0 and drain.inflight == 1


async def test_a_pause_past_its_deadline_cuts_off_the_calls_that_have_not_responded() -> None:
    drain = Drain(wait_s=30, retry_after_s=5, pause_deadline_s=0.05)
    slow, done = asyncio.Event(), asyncio.Event()

    async def call(respond: bool) -> str | None:
        flight = await drain.admit()
        try:
            flight.responded = respond  # the answer went out; only the record is left
            await (done if respond else slow).wait()
        except asyncio.CancelledError:
            return flight.cut_reason
        finally:
            drain.leave(flight)
        return None

    calls = [asyncio.ensure_future(call(respond)) for respond in (False, True)]
    while drain.inflight < 2:
        await asyncio.sleep(0)
    pausing = asyncio.ensure_future(drain.pause())
    assert await calls[0] == "pause_deadline"
    done.set()  # the call that responded is never cut: it finishes
    await pausing
    assert await calls[1] is None and drain.cut_off == {"pause_deadline": 1}


async def test_a_paused_drain_answers_429_after_its_wait_and_a_closed_one_503() -> None:
    drain = Drain(wait_s=0, retry_after_s=0.2)
    await drain.pause()
    with pytest.raises(GatewayHTTPError) as info:
        await drain.admit()
    assert info.value.status == 429 and info.value.headers == [(b"retry-after", b"1")]
    waiting = Drain(wait_s=30, retry_after_s=5)
    await waiting.pause()
    held = asyncio.ensure_future(waiting.admit())
    await asyncio.sleep(0.01)
    await waiting.close()
    with pytest.raises(GatewayHTTPError, match="the run is ending") as info:
        await held
    assert info.value.status == 503 and waiting.waiting == 0


# ---- upstream ------------------------------------------------------------------------------
def test_new_rollouts_spread_over_replicas_and_stay_unless_moved_off_one() -> None:
    upstream = Upstream(
        ["http://a/v1/", "http://b/v1"],
        Backoff(0, 0, 0),
        timeout_s=1,
        connect_timeout_s=1,
        api_key=None,
        max_connections=1,
    )
    assert upstream.backends == ["http://a/v1", "http://b/v1"]
    picks = {rid: upstream.pick(rid) for rid in ["r1", "r2", "r3", "r4"]}
    assert sorted(picks.values()) == [0, 0, 1, 1]  # ties go to the replica with fewer pins
    assert all(upstream.pick(rid) == idx for rid, idx in picks.items())
    moved = upstream.pick("r1", avoid=picks["r1"])
    assert moved != picks["r1"] and upstream.pick("r1") == moved


def test_the_backend_is_asked_for_ids_logprobs_and_usage_keeping_the_clients_options() -> None:
    streamed = call(model="m", messages=[], stream=True, stream_options={"continuous": True})
    body = backend_body(
        streamed, model="served", model_for_agent=lambda agent: None, request_token_ids=True
    )
    assert body["model"] == "served" and body["return_token_ids"] is True
    assert (body["logprobs"], body["top_logprobs"]) == (True, 0)
    assert body["stream_options"] == {"continuous": True, "include_usage": True}
    assert streamed.body["stream_options"] == {"continuous": True}  # the record keeps the request
    adapter = backend_body(
        call(model="m"), model=None, model_for_agent=lambda agent: agent, request_token_ids=False
    )
    assert adapter["model"] == "writer" and "return_token_ids" not in adapter


async def test_voltrls_clients_drop_an_idle_connection_before_its_servers_close_it() -> None:
    """A pooled connection a client still trusts while the server closes it fails the next
    request (``ServerDisconnectedError``, retried): the gateway's client to its backends, the
    store's and the agents' OpenAI clients let idle connections go before VoltRL's servers
    (uvicorn) do."""
    from starlette.applications import Starlette

    from voltrl._http import CLIENT_KEEPALIVE_S
    from voltrl._http.serving import _config
    from voltrl.openai_clients import LIMITS, SHARD_LIMITS
    from voltrl.store.http.client import HTTPStore

    server_keepalive = _config(Starlette(), "127.0.0.1", 0, "warning", 1.0).timeout_keep_alive
    assert server_keepalive > CLIENT_KEEPALIVE_S
    upstream = Upstream(
        ["http://127.0.0.1:1/v1"], Backoff(0, 0, 0), timeout_s=1, connect_timeout_s=1, api_key=None,
        max_connections=4,
    )  # fmt: skip
    store = HTTPStore("http://127.0.0.1:1")
    try:
        for session in (upstream._client(), store._http()):
            assert session.connector is not None
            assert session.connector._keepalive_timeout == CLIENT_KEEPALIVE_S  # aiohttp's own
    finally:
        await upstream.aclose()
        await store.close()
    assert LIMITS.keepalive_expiry == SHARD_LIMITS.keepalive_expiry == CLIENT_KEEPALIVE_S
