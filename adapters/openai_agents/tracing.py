"""The OpenAI Agents SDK's traces into the rollout: a ``TracingProcessor`` that replaces the
SDK's default exporter.

By default the SDK batches every trace and span to OpenAI's servers. :func:`install_tracing`
makes :class:`VoltRLTracingProcessor` the SDK's only processor, so nothing leaves the machine:
each span (agent, turn, generation, function/tool call with its input, output and error,
handoff, guardrail, custom, MCP tool listing) and each trace becomes a
:class:`~voltrl.types.Span` of the rollout that was running when it *started*, buffered on the
rollout like every other span. The rollout is found from context only: the rollout of the
trace a span belongs to, else the rollout of the context variables where the span or trace
starts. Spans started outside any rollout, and spans that end after their rollout finished,
are not recorded (counted in ``dropped``).
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from typing import Any

from agents import set_trace_processors, set_tracing_disabled
from agents.tracing import Span as SDKSpan
from agents.tracing import Trace, TracingProcessor

from voltrl.tracing import RolloutContext, find_rollout
from voltrl.types import Span

_installed: VoltRLTracingProcessor | None = None
_lock = threading.Lock()


def _jsonable(value: Any) -> Any:
    """``value`` as plain JSON (objects the SDK leaves in span data become strings)."""
    return json.loads(json.dumps(value, default=str))


def _time(iso: str | None, default: float) -> float:
    return datetime.fromisoformat(iso).timestamp() if iso else default


def span_fields(sdk_span: SDKSpan[Any]) -> tuple[str, dict[str, Any]]:
    """The SDK span's kind (``agent``, ``function``, ``turn``...) and exported data. Task and
    turn spans export as ``custom`` spans for OpenAI's backend; they are unwrapped here."""
    kind = sdk_span.span_data.type
    fields = dict(sdk_span.span_data.export() or {})
    inner = fields.get("data")
    if fields.get("type") == "custom" and isinstance(inner, dict) and "sdk_span_type" in inner:
        fields = {k: v for k, v in inner.items() if k != "sdk_span_type"}
    fields.pop("type", None)
    return kind, fields


def span_name(kind: str, fields: dict[str, Any]) -> str:
    """A readable span name: ``agent:Planner``, ``function:add``, ``handoff:A->B``,
    ``turn:1``, ``mcp_tools:<server>``, ``generation``..."""
    if kind == "handoff":
        return f"handoff:{fields.get('from_agent')}->{fields.get('to_agent')}"
    if kind == "turn":
        return f"turn:{fields.get('turn')}"
    name = fields.get("name") or fields.get("server")
    return f"{kind}:{name}" if name else kind


def span_attributes(kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The SDK span's data as ``openai_agents.*`` attributes, with the GenAI names the
    trajectory builder reads (``gen_ai.tool.name`` on tool calls, ``gen_ai.agent.name`` on
    agents and turns). A generation's messages are left out: the gateway records the exact
    request and response."""
    attrs: dict[str, Any] = {"openai_agents.type": kind}
    for key, value in fields.items():
        if value is not None and not (kind == "generation" and key in ("input", "output")):
            attrs[f"openai_agents.{key}"] = value
    if kind == "function":
        attrs["gen_ai.tool.name"] = fields.get("name")
    elif kind in ("agent", "turn"):
        attrs["gen_ai.agent.name"] = fields.get("name") or fields.get("agent_name")
    return _jsonable(attrs)


def to_span(sdk_span: SDKSpan[Any], ctx: RolloutContext) -> Span:
    """A finished SDK span as our :class:`~voltrl.types.Span` of the rollout ``ctx``."""
    kind, fields = span_fields(sdk_span)
    error = sdk_span.error
    events = []
    if error:
        events.append(
            {
                "name": "exception",
                "time": _time(sdk_span.ended_at, time.time()),
                "message": error.get("message"),
                "attributes": _jsonable(error.get("data") or {}),
            }
        )
    end = _time(sdk_span.ended_at, time.time())
    return Span(
        rollout_id=ctx.rollout_id,
        attempt_id=ctx.attempt_id,
        trace_id=sdk_span.trace_id,
        span_id=sdk_span.span_id,
        parent_id=sdk_span.parent_id or sdk_span.trace_id,
        name=span_name(kind, fields),
        start_time=_time(sdk_span.started_at, end),
        end_time=end,
        attributes=span_attributes(kind, fields),
        events=events,
        status="error" if error else "ok",
    )


class VoltRLTracingProcessor(TracingProcessor):
    """Records the SDK's spans and traces into the rollout current when each started.

    Install it with :func:`install_tracing` (which also removes the default exporter).
    Thread-safe; never raises into the agent.
    """

    def __init__(self) -> None:
        self._owners: dict[str, RolloutContext] = {}
        self._traces: dict[str, tuple[RolloutContext, float]] = {}
        self._lock = threading.Lock()
        self.dropped = 0

    def on_trace_start(self, trace: Trace) -> None:
        """Remember the rollout this trace (one ``Runner.run``) belongs to."""
        ctx = find_rollout()
        if ctx is not None:
            with self._lock:
                self._traces[trace.trace_id] = (ctx, time.time())

    def on_trace_end(self, trace: Trace) -> None:
        """Record the trace as the root span of its SDK spans (``trace:<workflow name>``)."""
        with self._lock:
            owner = self._traces.pop(trace.trace_id, None)
            if owner is None:
                self.dropped += 1
                return
        ctx, started = owner
        exported = trace.export() or {}
        attrs = {f"openai_agents.{k}": v for k, v in exported.items() if v is not None}
        recorded = ctx.add_span_if_running(
            Span(
                rollout_id=ctx.rollout_id,
                attempt_id=ctx.attempt_id,
                trace_id=trace.trace_id,
                span_id=trace.trace_id,
                name=f"trace:{trace.name}",
                start_time=started,
                end_time=time.time(),
                attributes=_jsonable(attrs),
                status="ok",
            )
        )
        if not recorded:
            with self._lock:
                self.dropped += 1

    def on_span_start(self, span: SDKSpan[Any]) -> None:
        """Remember the rollout this span belongs to: its trace's, else the context's."""
        with self._lock:
            owner = self._traces.get(span.trace_id)
        ctx = owner[0] if owner is not None else find_rollout()
        if ctx is not None and not ctx.finished:
            with self._lock:
                self._owners[span.span_id] = ctx

    def on_span_end(self, span: SDKSpan[Any]) -> None:
        """Add the finished span to its rollout's buffer (unless that rollout finished)."""
        with self._lock:
            ctx = self._owners.pop(span.span_id, None)
        if ctx is None or not ctx.add_span_if_running(to_span(span, ctx)):
            with self._lock:
                self.dropped += 1

    def shutdown(self) -> None:
        """Forget spans and traces that never ended."""
        with self._lock:
            self._owners.clear()
            self._traces.clear()

    def force_flush(self) -> None:
        """Nothing is buffered here: spans go to their rollout as they end."""


def install_tracing(processor: VoltRLTracingProcessor | None = None) -> VoltRLTracingProcessor:
    """Make ``processor`` (default: one shared per process) the SDK's only trace processor.

    This replaces the SDK's default exporter, so no trace is sent to OpenAI's servers, and
    turns SDK tracing on (``OPENAI_AGENTS_DISABLE_TRACING`` would otherwise leave the rollout
    without its spans; with the exporter gone, nothing is exported). Calling it again
    re-installs the same processor. To keep another processor as well, add it afterwards
    with ``agents.add_trace_processor``. Returns the processor.
    """
    global _installed
    with _lock:
        if processor is None:
            processor = _installed or VoltRLTracingProcessor()
        _installed = processor
    set_trace_processors([processor])
    set_tracing_disabled(False)
    return processor


def ensure_tracing() -> VoltRLTracingProcessor:
    """:func:`install_tracing` unless this process has already installed it (what
    :func:`~voltrl.adapters.openai_agents.model` calls, so that rollouts in runner processes
    record their spans and never export them)."""
    with _lock:
        installed = _installed
    return installed if installed is not None else install_tracing()
