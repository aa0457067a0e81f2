"""AutoGen's OpenTelemetry spans into the rollout.

AutoGen (autogen-core 0.7) traces with OpenTelemetry: ``create_agent``/``invoke_agent`` spans
around agents, an ``execute_tool`` span around every tool run (status ``error`` when the tool
raised), and runtime spans for teams. The GenAI spans always use the *global* tracer
provider (``opentelemetry.trace.get_tracer("autogen-core")``); a runtime
(``SingleThreadedAgentRuntime(tracer_provider=...)``) uses the one it is given, else the
global one. :func:`instrument` puts VoltRL's span processor on the global provider, so every
span lands in the rollout that was running when it started.

The tool span does not say what the tool returned. AutoGen's ``AssistantAgent`` logs each
round of tool results (a ``ToolCallExecutionEvent`` on the ``autogen_agentchat.events``
logger); :func:`instrument` reads those and writes each result onto its tool span (matched
by the tool-call id): ``gen_ai.tool.call.result``, ``voltrl.tool.is_error``, and status
``ok`` or ``error``. That logger is set to DEBUG so the events are made, and a filter keeps
records below the level it had from reaching your handlers, so your logs look the same.
"""

from __future__ import annotations

import logging
import threading

from autogen_agentchat import EVENT_LOGGER_NAME
from autogen_agentchat.messages import ToolCallExecutionEvent
from opentelemetry.sdk.trace import TracerProvider

from voltrl.otel import install_tracer_provider
from voltrl.tracing import find_rollout

TOOL_CALL_ID = "gen_ai.tool.call.id"  # AutoGen's attribute on its execute_tool spans
TOOL_RESULT = "gen_ai.tool.call.result"
TOOL_IS_ERROR = "voltrl.tool.is_error"

_lock = threading.Lock()
_filter: _ToolResultFilter | None = None


class _ToolResultFilter(logging.Filter):
    """Copies tool results from AutoGen's events onto the rollout's tool spans, and lets
    through only the records the logger would have let through had we not lowered its level
    (its own level from before, else its parent's effective level, looked up now)."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger
        self.own_level = logger.level

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, ToolCallExecutionEvent):
            record_tool_results(record.msg)
        parent = self.logger.parent
        level = self.own_level or (parent.getEffectiveLevel() if parent else logging.WARNING)
        return record.levelno >= level


def record_tool_results(event: ToolCallExecutionEvent) -> int:
    """Write each result of ``event`` onto the current rollout's ``execute_tool`` span with
    the same tool-call id; returns how many spans were updated."""
    ctx = find_rollout()
    if ctx is None:
        return 0
    by_call = {r.call_id: r for r in event.content}
    updated = 0
    for span in list(ctx.spans):
        result = by_call.get(str(span.attributes.get(TOOL_CALL_ID)))
        if result is None or TOOL_RESULT in span.attributes:
            continue
        span.attributes[TOOL_RESULT] = result.content
        span.attributes[TOOL_IS_ERROR] = bool(result.is_error)
        span.status = "error" if result.is_error else "ok"
        updated += 1
    return updated


def instrument() -> TracerProvider:
    """Record AutoGen's spans (agent steps, tool calls with their results) into rollouts.

    Puts VoltRL's span processor on the global SDK tracer provider (made if there is none)
    and returns that provider. :func:`~voltrl.adapters.autogen.model_client` calls it; call
    it yourself when your agents use another model client. Once per process is enough,
    before or after building agents (AutoGen looks the global provider up when it starts a
    span); calling it again changes nothing. A runtime you build yourself uses the global
    provider unless you give it another (``SingleThreadedAgentRuntime(tracer_provider=...)``);
    runtime spans of teams can be switched off with AutoGen's
    ``AUTOGEN_DISABLE_RUNTIME_TRACING=true``, while agent and tool spans stay.
    """
    global _filter
    provider = install_tracer_provider()
    with _lock:
        if _filter is None:
            logger = logging.getLogger(EVENT_LOGGER_NAME)
            _filter = _ToolResultFilter(logger)
            logger.addFilter(_filter)
            logger.setLevel(logging.DEBUG)
    return provider


def tracer_provider() -> TracerProvider:
    """The global tracer provider AutoGen's spans go to, instrumented (:func:`instrument`)."""
    return instrument()
