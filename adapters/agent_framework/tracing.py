"""Agent Framework's own OpenTelemetry spans, recorded into the rollout that made them.

Agent Framework instruments agents (``invoke_agent <name>``), model calls (``chat <model>``),
tool calls (``execute_tool <tool>``, status ``error`` with ``error.type`` when the tool
raised) and MCP requests through the *global* OpenTelemetry tracer provider.
:func:`instrument` puts VoltRL's :class:`~voltrl.otel.RolloutSpanProcessor` on that provider
(making an exporter-less SDK provider global when there is none) and turns the framework's
instrumentation on. It configures no exporter: spans go to the rollout, which reports them to
the store with the attempt's result. Agent Framework sends telemetry elsewhere only through
``configure_otel_providers`` (or exporters a user adds), which this never calls.
"""

from __future__ import annotations

from agent_framework.observability import enable_instrumentation
from opentelemetry.sdk.trace import TracerProvider

from voltrl.otel import install_tracer_provider


def instrument(*, sensitive_data: bool = True) -> TracerProvider:
    """Record Agent Framework's spans in the current rollout; returns the global provider.

    Safe to call more than once and from every rollout (worker processes run it too).
    ``sensitive_data`` (default on) adds tool-call arguments and results, messages and
    exception messages to the spans; they stay in the run's store, which holds the same
    messages from the gateway already. With it off, spans carry names, ids, token counts and
    error types only.
    """
    provider = install_tracer_provider()
    enable_instrumentation(enable_sensitive_data=sensitive_data, enable_message_events=False)
    return provider
