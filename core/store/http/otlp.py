"""OTLP/HTTP trace export into the store: agents in any language report spans and rewards.

The store server accepts ``POST /v1/traces`` (at its root, where an OpenTelemetry SDK sends
traces when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is the server's URL, and under ``/v1/store``), in
both OTLP/HTTP encodings:

- ``Content-Type: application/x-protobuf``: an ``ExportTraceServiceRequest`` message;
- ``Content-Type: application/json``: its OTLP JSON form (lowerCamelCase fields, ids as hex).

``Content-Encoding: gzip`` is accepted; the bearer token and the body limit are the store's.

**Which rollout a span belongs to.** Each span is tagged by the first of:

1. its own attributes ``voltrl.rollout_id`` / ``voltrl.attempt_id`` (what
   :class:`voltrl.otel.RolloutSpanProcessor` sets on Python spans);
2. its resource's attributes of the same names (set once per process or rollout, e.g.
   ``OTEL_RESOURCE_ATTRIBUTES=voltrl.rollout_id=ro-...,voltrl.attempt_id=at-...``);
3. the request headers ``x-rollout-id`` / ``x-attempt-id`` (the gateway's header convention;
   ``OTEL_EXPORTER_OTLP_HEADERS=x-rollout-id=ro-...``).

Without an attempt id, the span goes to the rollout's running attempt, else its latest one.

**Rewards.** A span with the attribute ``voltrl.reward`` (a finite number) also records a
:class:`~voltrl.types.Reward` of that value (``source="span"``), named by ``voltrl.reward.name``
(default ``"reward"``), with ``voltrl.reward.step`` as its step when given.

**Answers.** Spans are converted to :class:`~voltrl.types.Span` (ids as hex, times in seconds,
attributes and events as JSON values, the resource's attributes under ``otel.resource``, the
scope's name as ``otel.scope.name``; links are not kept) and stored with ``add_spans``. A span
that cannot be stored (no rollout id, an unknown rollout or attempt, a rollout without attempts,
a reward that is not a finite number) is rejected alone: the answer is 200 with OTLP's
``partial_success`` (``rejected_spans`` and an ``error_message`` naming the reasons), in the
request's encoding. A body that is not OTLP gets 400, an unsupported content type 415, both
with the store's JSON error body.

Spans sent here are stored when they arrive, outside any attempt report, as with the store's
``/spans`` route; an exporter that retries a request it thinks failed may store a span twice.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from starlette.exceptions import HTTPException

from voltrl.store.base import Store
from voltrl.types import Attempt, Reward, Span

OTLP_PATH = "/v1/traces"
"""Where OTLP/HTTP exporters send traces (the path the OTLP specification gives)."""

ROLLOUT_ID = "voltrl.rollout_id"
ATTEMPT_ID = "voltrl.attempt_id"
REWARD = "voltrl.reward"
REWARD_NAME = "voltrl.reward.name"
REWARD_STEP = "voltrl.reward.step"
ROLLOUT_HEADER = "x-rollout-id"
ATTEMPT_HEADER = "x-attempt-id"

PROTOBUF = "application/x-protobuf"
JSON = "application/json"

OTLP_REQUEST_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
            JSON: {
                "schema": {"type": "object", "properties": {"resourceSpans": {"type": "array"}}}
            },
        },
    }
}
"""The OpenAPI description of the request body (OTLP's own schema is protobuf)."""

_STATUS = {0: "unset", 1: "ok", 2: "error"}
_NS = 1e-9


@dataclass
class _Batch:
    """Spans and rewards converted from one request, and what was rejected and why."""

    spans: list[Span] = field(default_factory=list)
    rewards: list[Reward] = field(default_factory=list)
    rejected: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def reject(self, reason: str) -> None:
        self.rejected += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def message(self) -> str:
        return "; ".join(f"{reason} ({n} spans)" for reason, n in self.reasons.items())


@dataclass
class _Raw:
    """One span as sent, in neither encoding: what both readers produce."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[dict[str, Any]]
    status: int
    status_message: str
    resource: dict[str, Any]
    scope: str


# ---- protobuf --------------------------------------------------------------------------------
def _pb_value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_pb_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return _pb_attributes(v.kvlist_value.values)
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return None if kind is None else getattr(v, kind)


def _pb_attributes(kvs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: _pb_value(kv.value) for kv in kvs}


def _read_protobuf(body: bytes) -> Iterator[_Raw]:
    try:
        request = ExportTraceServiceRequest.FromString(body)
    except DecodeError as e:
        raise HTTPException(400, f"body is not an OTLP ExportTraceServiceRequest: {e}") from e
    for rs in request.resource_spans:
        resource = _pb_attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                yield _Raw(
                    name=s.name,
                    trace_id=s.trace_id.hex(),
                    span_id=s.span_id.hex(),
                    parent_id=s.parent_span_id.hex() or None,
                    start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano,
                    attributes=_pb_attributes(s.attributes),
                    events=[
                        {
                            "name": e.name,
                            "time": e.time_unix_nano * _NS,
                            "attributes": _pb_attributes(e.attributes),
                        }
                        for e in s.events
                    ],
                    status=s.status.code,
                    status_message=s.status.message,
                    resource=resource,
                    scope=ss.scope.name,
                )


# ---- JSON ------------------------------------------------------------------------------------
def _json_id(value: Any) -> str:
    """An OTLP JSON id: hex as the specification says; base64 (proto3 JSON) also accepted."""
    if not value:
        return ""
    text = str(value)
    try:
        bytes.fromhex(text)
        return text.lower()
    except ValueError:
        try:
            return base64.b64decode(text, validate=True).hex()
        except (binascii.Error, ValueError):
            raise ValueError(f"id {text!r} is neither hex nor base64") from None


def _json_value(v: dict[str, Any]) -> Any:
    if "arrayValue" in v:
        return [_json_value(x) for x in v["arrayValue"].get("values", [])]
    if "kvlistValue" in v:
        return _json_attributes(v["kvlistValue"].get("values", []))
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "bytesValue" in v:
        return base64.b64decode(v["bytesValue"]).hex()
    for kind in ("stringValue", "boolValue"):
        if kind in v:
            return v[kind]
    return None


def _json_attributes(kvs: list[dict[str, Any]]) -> dict[str, Any]:
    return {kv["key"]: _json_value(kv.get("value") or {}) for kv in kvs}


def _read_json(body: bytes) -> list[_Raw]:
    try:
        request = json.loads(body)
        out = []
        for rs in request.get("resourceSpans") or []:
            resource = _json_attributes((rs.get("resource") or {}).get("attributes") or [])
            for ss in rs.get("scopeSpans") or []:
                scope = (ss.get("scope") or {}).get("name", "")
                for s in ss.get("spans") or []:
                    status = s.get("status") or {}
                    out.append(
                        _Raw(
                            name=str(s.get("name", "")),
                            trace_id=_json_id(s.get("traceId")),
                            span_id=_json_id(s.get("spanId")),
                            parent_id=_json_id(s.get("parentSpanId")) or None,
                            start_ns=int(s.get("startTimeUnixNano") or 0),
                            end_ns=int(s.get("endTimeUnixNano") or 0),
                            attributes=_json_attributes(s.get("attributes") or []),
                            events=[
                                {
                                    "name": e.get("name", ""),
                                    "time": int(e.get("timeUnixNano") or 0) * _NS,
                                    "attributes": _json_attributes(e.get("attributes") or []),
                                }
                                for e in s.get("events") or []
                            ],
                            status=_json_status_code(status.get("code", 0)),
                            status_message=str(status.get("message", "")),
                            resource=resource,
                            scope=str(scope),
                        )
                    )
        return out
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise HTTPException(400, f"body is not OTLP JSON: {type(e).__name__}: {e}") from e


def _json_status_code(code: Any) -> int:
    """A status code given as a number or as its enum name (``STATUS_CODE_OK``)."""
    names = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}
    return names[code] if isinstance(code, str) and code in names else int(code)


# ---- conversion ------------------------------------------------------------------------------
def _reward_value(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{REWARD} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{REWARD} must be finite, got {value!r}")
    return float(value)


def _tag(raw: _Raw, headers: dict[str, str], key: str, header: str) -> str | None:
    value = raw.attributes.get(key) or raw.resource.get(key) or headers.get(header)
    return None if value is None else str(value)


def _span(raw: _Raw, rollout_id: str, attempt_id: str) -> Span:
    attributes = dict(raw.attributes)
    if raw.resource:
        attributes["otel.resource"] = raw.resource
    if raw.scope:
        attributes["otel.scope.name"] = raw.scope
    events = list(raw.events)
    if raw.status_message:
        events.append({"name": "status", "message": raw.status_message})
    kwargs: dict[str, Any] = {"trace_id": raw.trace_id} if raw.trace_id else {}
    if raw.span_id:
        kwargs["span_id"] = raw.span_id
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        parent_id=raw.parent_id,
        name=raw.name,
        start_time=raw.start_ns * _NS,
        end_time=raw.end_ns * _NS if raw.end_ns else None,
        attributes=attributes,
        events=events,
        status=_STATUS.get(raw.status, "unset"),  # type: ignore[arg-type]
        **kwargs,
    )


def _current_attempt(attempts: list[Attempt]) -> str | None:
    """The running attempt, else the latest; None if there is none."""
    running = [a for a in attempts if a.status == "running"]
    chosen = running[-1] if running else attempts[-1] if attempts else None
    return None if chosen is None else chosen.attempt_id


async def convert(store: Store, raws: list[_Raw], headers: dict[str, str]) -> _Batch:
    """Tag each span with its rollout and attempt, and turn it into our records."""
    batch = _Batch()
    wanted = {rid for raw in raws if (rid := _tag(raw, headers, ROLLOUT_ID, ROLLOUT_HEADER))}
    found = await store.query_rollouts(rollout_ids=sorted(wanted)) if wanted else []
    attempts = {r.rollout_id: await store.get_attempts(r.rollout_id) for r in found}
    for raw in raws:
        rollout_id = _tag(raw, headers, ROLLOUT_ID, ROLLOUT_HEADER)
        if rollout_id is None:
            batch.reject(f"no {ROLLOUT_ID} attribute or {ROLLOUT_HEADER} header")
            continue
        if rollout_id not in attempts:
            batch.reject(f"unknown rollout {rollout_id!r}")
            continue
        attempt_id = _tag(raw, headers, ATTEMPT_ID, ATTEMPT_HEADER)
        if attempt_id is None:
            attempt_id = _current_attempt(attempts[rollout_id])
            if attempt_id is None:
                batch.reject(f"rollout {rollout_id!r} has no attempt yet")
                continue
        elif attempt_id not in {a.attempt_id for a in attempts[rollout_id]}:
            batch.reject(f"unknown attempt {attempt_id!r} of rollout {rollout_id!r}")
            continue
        try:
            span = _span(raw, rollout_id, attempt_id)
            if REWARD in raw.attributes:
                step = raw.attributes.get(REWARD_STEP)
                reward = Reward(
                    rollout_id=rollout_id,
                    attempt_id=attempt_id,
                    value=_reward_value(raw.attributes[REWARD]),
                    name=str(raw.attributes.get(REWARD_NAME, "reward")),
                    step=None if step is None else int(step),
                    source="span",
                    timestamp=(raw.end_ns or raw.start_ns) * _NS or span.start_time,
                )
                batch.rewards.append(reward)
        except (ValueError, TypeError) as e:  # pydantic's ValidationError included
            batch.reject(f"span {raw.name!r}: {str(e).splitlines()[0]}")
            continue
        batch.spans.append(span)
    return batch


def _decompress(body: bytes, encoding: str, max_bytes: int) -> bytes:
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise HTTPException(415, f"unsupported Content-Encoding {encoding!r}; use gzip")
    inflate = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib header
    try:
        out = inflate.decompress(body, max_bytes + 1)
    except zlib.error as e:
        raise HTTPException(400, f"body is not valid {encoding}: {e}") from e
    if len(out) > max_bytes:
        raise HTTPException(413, f"decompressed body over the limit of {max_bytes} bytes")
    return out


def _answer(batch: _Batch, protobuf: bool) -> Response:
    if protobuf:
        answer = ExportTraceServiceResponse()
        if batch.rejected:
            answer.partial_success.CopyFrom(
                ExportTracePartialSuccess(
                    rejected_spans=batch.rejected, error_message=batch.message()
                )
            )
        return Response(answer.SerializeToString(), media_type=PROTOBUF)
    body: dict[str, Any] = {}
    if batch.rejected:
        body["partialSuccess"] = {
            "rejectedSpans": str(batch.rejected),
            "errorMessage": batch.message(),
        }
    return Response(json.dumps(body).encode(), media_type=JSON)


async def export_traces(store: Store, request: Request, *, max_bytes: int) -> Response:
    """Handle one OTLP/HTTP trace export request (see the module docstring)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in (PROTOBUF, JSON):
        raise HTTPException(
            415, f"unsupported Content-Type {content_type!r}; send {PROTOBUF} or {JSON}"
        )
    encoding = request.headers.get("content-encoding", "").strip().lower()
    body = _decompress(await request.body(), encoding, max_bytes)
    protobuf = content_type == PROTOBUF
    raws = list(_read_protobuf(body)) if protobuf else _read_json(body)
    headers = {
        k: request.headers[k] for k in (ROLLOUT_HEADER, ATTEMPT_HEADER) if k in request.headers
    }
    batch = await convert(store, raws, headers)
    if batch.spans:
        await store.add_spans(batch.spans)
    if batch.rewards:
        await store.add_rewards(batch.rewards)
    return _answer(batch, protobuf)
