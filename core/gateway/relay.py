"""The relay: a backend's answer back to the client, as the client asked for it, recorded on the
way.

Both relays record the call before the last bytes go out, so when a client's call returns its
record is in the store. The extra fields the gateway asked for (token ids, logprobs, a stream's
usage) are removed unless the client asked for them too, and with the reasoning split on, a
chat model's ``<think>...</think>`` reaches the client as ``reasoning_content``
(:mod:`voltrl.gateway.reasoning`) while the record keeps the response as sampled.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import aiohttp

from voltrl.gateway._asgi import ASGISend, send_bytes
from voltrl.gateway.errors import GatewayHTTPError
from voltrl.gateway.reasoning import ReasoningSplitter, flush_deltas, split_deltas, split_messages
from voltrl.gateway.records import (
    Call,
    Meta,
    Recorder,
    StreamAccumulator,
    calls_from_response,
    strip_extras,
)

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_DONE = b"data: [DONE]\n\n"


async def relay_response(
    call: Call,
    resp: aiohttp.ClientResponse,
    send: ASGISend,
    meta: Meta,
    recorder: Recorder,
    *,
    reasoning_split: bool,
    commit: Callable[[], None] = lambda: None,
) -> None:
    """Relay a non-streamed answer: record one call per choice, then send the JSON (502 when
    the backend's answer is not JSON). ``commit`` is called once the answer is complete,
    before it is recorded."""
    raw = await resp.read()
    try:
        data = json.loads(raw)
    except ValueError:
        raise GatewayHTTPError(
            502, f"backend sent a non-JSON response: {raw[:200]!r}", type="api_error"
        ) from None
    calls = calls_from_response(call, data, meta)
    strip_extras(call, data)
    if reasoning_split and call.kind == "chat":
        split_messages(data)
    commit()
    await recorder.record(calls)
    await send_bytes(send, 200, json.dumps(data, separators=(",", ":")).encode())


async def relay_stream(
    call: Call,
    resp: aiohttp.ClientResponse,
    send: ASGISend,
    meta: Meta,
    recorder: Recorder,
    *,
    reasoning_split: bool,
    commit: Callable[[], None] = lambda: None,
) -> None:
    """Relay a stream (SSE) event by event while accumulating the response; record it before
    ``[DONE]`` (``commit`` is called once the backend's stream has ended, before that). A
    backend that breaks off mid-stream ends it with an error event; what was sampled until
    then is recorded anyway, as it is when the client goes away (its unfinished choices
    marked abandoned)."""
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    acc = StreamAccumulator(call.kind)
    split: dict[int, ReasoningSplitter] | None = (
        {} if reasoning_split and call.kind == "chat" else None
    )
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
            out = _relay_event(call, acc, data, split)
            if out is not None:
                await send({"type": "http.response.body", "body": out, "more_body": True})
        if split and (last := flush_deltas(split, acc.head)) is not None:
            out = b"data: " + json.dumps(last, separators=(",", ":")).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": out, "more_body": True})
        recorded = True
        commit()
        await recorder.record(acc.calls(call, meta))
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
            recorder.record_later(acc.calls(call, meta, cut=True))
    await send({"type": "http.response.body", "body": _DONE, "more_body": False})


def _relay_event(
    call: Call,
    acc: StreamAccumulator,
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
    strip_extras(call, chunk)
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
