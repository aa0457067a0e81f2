"""AgentScope's own OpenTelemetry spans, recorded into the rollout that made them.

``agentscope.middleware.TracingMiddleware`` (put it on your agents: ``Agent(...,
middlewares=[TracingMiddleware()])``) emits ``invoke_agent <name>`` for each reply, ``chat
<model>`` for each model call and ``execute_tool <tool>`` for each tool call (arguments,
result), through the *global* tracer provider, and only when that is an SDK provider.
:func:`instrument` puts VoltRL's :class:`~voltrl.otel.RolloutSpanProcessor` on it (making an
exporter-less SDK provider global when there is none). It configures no exporter: spans go to
the rollout, which reports them to the store with the attempt's result.
"""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider

from voltrl.otel import install_tracer_provider


def instrument() -> TracerProvider:
    """Record AgentScope's spans in the current rollout; returns the global provider. Safe to
    call more than once and from every rollout (worker processes run it too)."""
    return install_tracer_provider()
