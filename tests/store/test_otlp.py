"""The store server's OTLP/HTTP endpoint: spans from a real OpenTelemetry SDK reach rollouts.

The OTLP exporter package is not a dependency, so the SDK's finished spans are encoded into an
``ExportTraceServiceRequest`` here (as the exporter does) and posted with httpx, in protobuf
and in OTLP JSON. Servers are real uvicorn servers on loopback.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as PbResource
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from voltrl._http.serving import BackgroundServer, serve_in_thread
from voltrl.store.http import HTTPStore
from voltrl.store.http.endpoints import store_app
from voltrl.store.memory import InMemoryStore
from voltrl.types import Claim, Task

TOKEN = "otlp-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROTOBUF = {**AUTH, "Content-Type": "application/x-protobuf"}


# ---- encoding SDK spans as the OTLP exporter does --------------------------------------------
def any_value(v: Any) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, list | tuple):
        return AnyValue(array_value={"values": [any_value(x) for x in v]})
    return AnyValue(string_value=str(v))


def key_values(attributes: Any) -> list[KeyValue]:
    return [KeyValue(key=k, value=any_value(v)) for k, v in (attributes or {}).items()]


def encode(spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
    """One ResourceSpans per resource, one ScopeSpans per instrumentation scope."""
    request = ExportTraceServiceRequest()
    for resource in {id(s.resource): s.resource for s in spans}.values():
        rs = request.resource_spans.add(
            resource=PbResource(attributes=key_values(resource.attributes))
        )
        for span in (s for s in spans if s.resource is resource):
            scope = span.instrumentation_scope
            ss = rs.scope_spans.add(scope=InstrumentationScope(name=scope.name if scope else ""))
            ctx, parent = span.get_span_context(), span.parent
            ss.spans.append(
                trace_pb2.Span(
                    trace_id=ctx.trace_id.to_bytes(16, "big"),
                    span_id=ctx.span_id.to_bytes(8, "big"),
                    parent_span_id=parent.span_id.to_bytes(8, "big") if parent else b"",
                    name=span.name,
                    start_time_unix_nano=span.start_time or 0,
                    end_time_unix_nano=span.end_time or 0,
                    attributes=key_values(span.attributes),
                    events=[
                        trace_pb2.Span.Event(
                            name=e.name,
                            time_unix_nano=e.timestamp,
                            attributes=key_values(e.attributes),
                        )
                        for e in span.events
                    ],
                    status=trace_pb2.Status(
                        code=span.status.status_code.value, message=span.status.description or ""
                    ),
                )
            )
    return request


def sdk_spans(
    resource_attributes: dict[str, str], reward: float | None = None
) -> list[ReadableSpan]:
    """A parent span with a child and an event, as an agent's OTel SDK would finish them."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(resource_attributes))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("my-agent")
    with tracer.start_as_current_span("agent.run", attributes={"task": "2+2"}):
        with tracer.start_as_current_span("llm.call", attributes={"tokens": 12}) as child:
            child.add_event("retry", {"attempt": 1})
            child.set_status(Status(StatusCode.ERROR, "rate limited"))
        if reward is not None:
            tracer.start_span("score", attributes={"voltrl.reward": reward}).end()
    provider.shutdown()
    return list(exporter.get_finished_spans())


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture
def server() -> Iterator[BackgroundServer]:
    with serve_in_thread(store_app(InMemoryStore(), token=TOKEN, max_body_bytes=64 * 1024)) as s:
        yield s


@pytest.fixture
async def store(server: BackgroundServer) -> AsyncIterator[HTTPStore]:
    client = HTTPStore(server.url, TOKEN)
    yield client
    await client.close()


async def claimed(store: HTTPStore) -> Claim:
    await store.enqueue([Task(input={"q": "2+2"})])
    claim = await store.claim("worker")
    assert claim is not None
    return claim


# ---- tests ------------------------------------------------------------------------------------
async def test_sdk_spans_in_protobuf_reach_their_rollout_with_a_reward(
    server: BackgroundServer, store: HTTPStore
) -> None:
    c = await claimed(store)
    rid, aid = c.rollout.rollout_id, c.attempt.attempt_id
    spans = sdk_spans({"voltrl.rollout_id": rid, "voltrl.attempt_id": aid}, reward=0.75)
    body = gzip.compress(encode(spans).SerializeToString())
    async with httpx.AsyncClient() as http:
        r = await http.post(
            server.url + "/v1/traces",
            content=body,
            headers={**PROTOBUF, "Content-Encoding": "gzip"},
        )
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-protobuf"
    assert not ExportTraceServiceResponse.FromString(r.content).HasField("partial_success")

    stored = {s.name: s for s in await store.get_spans(rid, aid)}
    assert set(stored) == {"agent.run", "llm.call", "score"}
    run, call = stored["agent.run"], stored["llm.call"]
    assert call.parent_id == run.span_id and call.trace_id == run.trace_id
    assert run.trace_id == format(spans[0].get_span_context().trace_id, "032x")
    assert call.attributes["tokens"] == 12 and call.attributes["otel.scope.name"] == "my-agent"
    assert call.attributes["otel.resource"]["voltrl.rollout_id"] == rid
    assert call.status == "error" and call.events[0]["name"] == "retry"
    assert call.events[0]["attributes"] == {"attempt": 1}
    assert call.end_time is not None and call.end_time >= call.start_time > 0
    assert sorted(s.sequence_id for s in stored.values()) == [0, 1, 2]
    [reward] = await store.get_rewards(rid)
    assert (reward.value, reward.source, reward.attempt_id) == (0.75, "span", aid)


async def test_otlp_json_under_the_store_prefix_tagged_by_span_attributes(
    server: BackgroundServer, store: HTTPStore
) -> None:
    c = await claimed(store)
    rid = c.rollout.rollout_id
    span = {
        "traceId": "5b8efff798038103d269b633813fc60c",
        "spanId": "eee19b7ec3c1b174",
        "name": "tool.search",
        "startTimeUnixNano": "1700000000000000000",
        "endTimeUnixNano": "1700000000500000000",
        "attributes": [
            {"key": "voltrl.rollout_id", "value": {"stringValue": rid}},
            {"key": "voltrl.reward", "value": {"doubleValue": 1.0}},
            {"key": "voltrl.reward.name", "value": {"stringValue": "found"}},
            {"key": "hits", "value": {"intValue": "3"}},
            {"key": "tags", "value": {"arrayValue": {"values": [{"stringValue": "a"}]}}},
        ],
        "status": {"code": "STATUS_CODE_OK"},
    }
    body = {"resourceSpans": [{"scopeSpans": [{"scope": {"name": "go-agent"}, "spans": [span]}]}]}
    async with httpx.AsyncClient() as http:
        r = await http.post(server.url + "/v1/store/v1/traces", json=body, headers=AUTH)
    assert r.status_code == 200 and r.json() == {}
    [stored] = await store.get_spans(rid)
    assert stored.attempt_id == c.attempt.attempt_id  # no attempt id: the running attempt
    assert (stored.span_id, stored.status, stored.end_time) == (
        "eee19b7ec3c1b174",
        "ok",
        1.7e9 + 0.5,
    )
    assert stored.attributes["hits"] == 3 and stored.attributes["tags"] == ["a"]
    [reward] = await store.get_rewards(rid)
    assert (reward.name, reward.value) == ("found", 1.0)


async def test_rollout_header_tags_spans_that_carry_no_ids(
    server: BackgroundServer, store: HTTPStore
) -> None:
    c = await claimed(store)
    body = encode(sdk_spans({"service.name": "ts-agent"})).SerializeToString()
    headers = {**PROTOBUF, "x-rollout-id": c.rollout.rollout_id}
    async with httpx.AsyncClient() as http:
        r = await http.post(server.url + "/v1/traces", content=body, headers=headers)
    assert r.status_code == 200
    spans = await store.get_spans(c.rollout.rollout_id, c.attempt.attempt_id)
    assert len(spans) == 2 and spans[0].attributes["otel.resource"]["service.name"] == "ts-agent"


async def test_spans_of_unknown_rollouts_are_rejected_alone(
    server: BackgroundServer, store: HTTPStore
) -> None:
    c = await claimed(store)
    good = sdk_spans({"voltrl.rollout_id": c.rollout.rollout_id})
    unknown = sdk_spans({"voltrl.rollout_id": "ro-nobody"})
    untagged = sdk_spans({})[:1]
    stranger = sdk_spans({"voltrl.rollout_id": c.rollout.rollout_id, "voltrl.attempt_id": "at-x"})
    body = encode([*good, *unknown, *untagged, *stranger[:1]]).SerializeToString()
    async with httpx.AsyncClient() as http:
        r = await http.post(server.url + "/v1/traces", content=body, headers=PROTOBUF)
        assert r.status_code == 200
        partial = ExportTraceServiceResponse.FromString(r.content).partial_success
        assert partial.rejected_spans == 4
        assert "unknown rollout 'ro-nobody' (2 spans)" in partial.error_message
        assert "no voltrl.rollout_id" in partial.error_message
        assert "unknown attempt 'at-x'" in partial.error_message

        bad_reward = {"key": "voltrl.reward", "value": {"stringValue": "great"}}
        span = {"name": "s", "attributes": [bad_reward]}
        body_json = {"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}
        headers = {**AUTH, "x-rollout-id": c.rollout.rollout_id}
        r = await http.post(server.url + "/v1/traces", json=body_json, headers=headers)
        assert r.status_code == 200 and r.json()["partialSuccess"]["rejectedSpans"] == "1"
        assert "voltrl.reward must be a number" in r.json()["partialSuccess"]["errorMessage"]
    assert len(await store.get_spans(c.rollout.rollout_id)) == 2
    assert await store.get_rewards(c.rollout.rollout_id) == []


async def test_bad_requests_get_json_4xx_and_store_nothing(
    server: BackgroundServer, store: HTTPStore
) -> None:
    c = await claimed(store)
    url = server.url + "/v1/traces"
    valid = encode(sdk_spans({"voltrl.rollout_id": c.rollout.rollout_id})).SerializeToString()
    cases: list[tuple[bytes, dict[str, str], int, str]] = [
        (b"\xff\xff not protobuf", PROTOBUF, 400, "not an OTLP ExportTraceServiceRequest"),
        (b"{not json", {**AUTH, "Content-Type": "application/json"}, 400, "not OTLP JSON"),
        (
            json.dumps({"resourceSpans": 3}).encode(),
            {**AUTH, "Content-Type": "application/json"},
            400,
            "not OTLP JSON",
        ),
        (valid, {**AUTH, "Content-Type": "text/plain"}, 415, "unsupported Content-Type"),
        (valid, {**PROTOBUF, "Content-Encoding": "gzip"}, 400, "not valid gzip"),
        (valid, {"Content-Type": "application/x-protobuf"}, 401, "bearer token"),
        (b"x" * 70_000, PROTOBUF, 413, "over the limit"),
        (
            gzip.compress(b"\x00" * 70_000),
            {**PROTOBUF, "Content-Encoding": "gzip"},
            413,
            "over the limit",
        ),
    ]
    async with httpx.AsyncClient() as http:
        for body, headers, status, message in cases:
            r = await http.post(url, content=body, headers=headers)
            assert r.status_code == status, (headers, r.text)
            assert message in r.json()["error"]["message"]
    assert await store.get_spans(c.rollout.rollout_id) == []
