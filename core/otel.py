"""OpenTelemetry spans into rollouts: frameworks instrumented with OTel report to the store.

AutoGen, Microsoft Agent Framework and many libraries emit OpenTelemetry spans. A
:class:`RolloutSpanProcessor` on the tracer provider they use turns each finished span into a
:class:`~voltrl.types.Span` of the rollout that was running when the span *started*, and adds it
to that rollout's buffer (:meth:`RolloutContext.add_span`): it reaches the store with the
attempt's result, like every other span, so a superseded attempt never writes.

The rollout is found from context only: the span's OpenTelemetry parent, when that parent is
an open span of a rollout (so a span started in any thread under an explicit parent context
follows it), else the rollout of the context variables where the span starts. Spans started
outside any rollout, and spans that end after their rollout finished, are not recorded
(counted in ``dropped``).

Needs ``opentelemetry-sdk`` (in the framework extras)::

    from voltrl.otel import install_tracer_provider
    provider = install_tracer_provider()   # the global provider, with our processor on it
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import StatusCode

from voltrl.tracing import RolloutContext, find_rollout
from voltrl.types import Span

_NS = 1e-9
_STATUS = {StatusCode.OK: "ok", StatusCode.ERROR: "error", StatusCode.UNSET: "unset"}
_installed: weakref.WeakSet[TracerProvider] = weakref.WeakSet()  # providers we processed


def _value(v: Any) -> Any:
    """An OTel attribute value as JSON (sequences are tuples in the SDK)."""
    return list(v) if isinstance(v, tuple) else v


def to_span(otel_span: ReadableSpan, rollout_id: str, attempt_id: str) -> Span:
    """An OTel SDK span as our :class:`~voltrl.types.Span` of one rollout attempt."""
    sc = otel_span.get_span_context()
    parent = otel_span.parent
    status = _STATUS.get(otel_span.status.status_code, "unset")
    events = [
        {
            "name": e.name,
            "time": e.timestamp * _NS,
            "attributes": {k: _value(v) for k, v in (e.attributes or {}).items()},
        }
        for e in otel_span.events
    ]
    if otel_span.status.description:
        events.append({"name": "status", "message": otel_span.status.description})
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        trace_id=format(sc.trace_id, "032x"),
        span_id=format(sc.span_id, "016x"),
        parent_id=format(parent.span_id, "016x") if parent is not None else None,
        name=otel_span.name,
        start_time=(otel_span.start_time or 0) * _NS,
        end_time=otel_span.end_time * _NS if otel_span.end_time else None,
        attributes={k: _value(v) for k, v in (otel_span.attributes or {}).items()},
        events=events,
        status=status,  # type: ignore[arg-type]
    )


class RolloutSpanProcessor(SpanProcessor):
    """Routes every span to the rollout that was current when it started.

    The owner is looked up at start (the span may end in a callback where the context is
    gone) and kept until the span ends; ``dropped`` counts spans that belonged to no rollout
    or ended after their rollout finished.
    """

    def __init__(self) -> None:
        self._owners: dict[int, RolloutContext] = {}
        self._lock = threading.Lock()
        self.dropped = 0

    def on_start(self, span: Any, parent_context: otel_context.Context | None = None) -> None:
        """Remember the rollout this span belongs to and tag the span with it."""
        ctx = self._owner(parent_context)
        if ctx is None:
            return
        span.set_attribute("voltrl.rollout_id", ctx.rollout_id)
        span.set_attribute("voltrl.attempt_id", ctx.attempt_id)
        with self._lock:
            self._owners[span.get_span_context().span_id] = ctx

    def _owner(self, parent_context: otel_context.Context | None) -> RolloutContext | None:
        """The rollout of the span's open parent, else of the context; None if finished."""
        parent = trace.get_current_span(parent_context).get_span_context()
        with self._lock:
            ctx = self._owners.get(parent.span_id) if parent.is_valid else None
        ctx = ctx or find_rollout()
        return ctx if ctx is not None and not ctx.finished else None

    def on_end(self, span: ReadableSpan) -> None:
        """Add the finished span to its rollout's buffer (unless that rollout finished)."""
        with self._lock:
            ctx = self._owners.pop(span.get_span_context().span_id, None)
        if ctx is None or not ctx.add_span_if_running(
            to_span(span, ctx.rollout_id, ctx.attempt_id)
        ):
            with self._lock:
                self.dropped += 1

    def shutdown(self) -> None:
        """Forget spans that never ended."""
        with self._lock:
            self._owners.clear()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is buffered here: spans go to their rollout as they end."""
        return True


def install_tracer_provider(provider: TracerProvider | None = None) -> TracerProvider:
    """Put a :class:`RolloutSpanProcessor` on ``provider``, on the global SDK provider, or on a
    new one made global; returns the provider. Calling it again adds no second processor."""
    if provider is None:
        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider):
            provider = current
        else:
            provider = TracerProvider()
            trace.set_tracer_provider(provider)
    if provider not in _installed:
        provider.add_span_processor(RolloutSpanProcessor())
        _installed.add(provider)
    return provider
