"""OpenTelemetry spans reach the rollout that was current when they started."""

from __future__ import annotations

import asyncio
import threading

from helpers import context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Status, StatusCode

from voltrl.otel import RolloutSpanProcessor, install_tracer_provider
from voltrl.tracing import RolloutContext, activate


def provider() -> tuple[TracerProvider, RolloutSpanProcessor]:
    p = TracerProvider()
    processor = RolloutSpanProcessor()
    p.add_span_processor(processor)
    return p, processor


async def test_concurrent_rollouts_get_their_own_spans() -> None:
    tracer = provider()[0].get_tracer("test")
    contexts = [context(f"r{i}") for i in range(3)]

    async def agent(ctx: RolloutContext) -> None:
        attributes = {"who": ctx.rollout_id}
        with activate(ctx), tracer.start_as_current_span("agent", attributes=attributes):
            for k in range(2):
                with tracer.start_as_current_span(f"tool:{k}"):
                    await asyncio.sleep(0)

    await asyncio.gather(*(agent(c) for c in contexts))
    for ctx in contexts:
        names = sorted(s.name for s in ctx.spans)
        assert names == ["agent", "tool:0", "tool:1"]
        root = next(s for s in ctx.spans if s.name == "agent")
        assert root.attributes["who"] == ctx.rollout_id
        assert root.attributes["voltrl.rollout_id"] == ctx.rollout_id
        assert {s.attempt_id for s in ctx.spans} == {ctx.attempt_id}
        children = [s for s in ctx.spans if s.name != "agent"]
        assert {s.parent_id for s in children} == {root.span_id}
        assert {s.trace_id for s in ctx.spans} == {root.trace_id}
        assert all(s.end_time is not None and s.end_time >= s.start_time for s in ctx.spans)


async def test_error_status_and_events_are_kept() -> None:
    tracer = provider()[0].get_tracer("test")
    ctx = context("r")
    with activate(ctx), tracer.start_as_current_span("tool:search") as span:
        span.add_event("retry", {"attempt": 2})
        span.set_status(Status(StatusCode.ERROR, "no results"))
    [s] = ctx.spans
    assert s.status == "error"
    assert s.events[0]["name"] == "retry" and s.events[0]["attributes"] == {"attempt": 2}
    assert s.events[-1] == {"name": "status", "message": "no results"}


def test_spans_outside_rollouts_are_dropped_and_counted() -> None:
    p, processor = provider()
    with p.get_tracer("test").start_as_current_span("orphan"):
        pass
    assert processor.dropped == 1


def test_install_adds_one_processor_per_provider() -> None:
    p = TracerProvider()
    assert install_tracer_provider(p) is p
    install_tracer_provider(p)
    ctx = context("r")
    with activate(ctx), p.get_tracer("t").start_as_current_span("once"):
        pass
    assert [s.name for s in ctx.spans] == ["once"]


def test_a_span_started_in_a_bare_thread_under_a_rollouts_span_joins_that_rollout() -> None:
    tracer = provider()[0].get_tracer("test")
    ctx = context("r")
    with activate(ctx), tracer.start_as_current_span("agent") as root:
        parent = trace.set_span_in_context(root)  # the OpenTelemetry context, passed by hand
        thread = threading.Thread(target=lambda: tracer.start_span("tool", context=parent).end())
        thread.start()
        thread.join()
    assert sorted(s.name for s in ctx.spans) == ["agent", "tool"]


def test_a_span_that_ends_after_its_rollout_finished_is_dropped() -> None:
    p, processor = provider()
    ctx = context("r")
    with activate(ctx):
        late = p.get_tracer("test").start_span("late")
    late.end()
    assert ctx.spans == [] and processor.dropped == 1
