"""LangChain callbacks → spans of the current rollout.

:class:`VoltRLCallbackHandler` records every LangChain run it sees (chains, LangGraph nodes,
chat models, tools, retrievers) as a :class:`~voltrl.types.Span` of the rollout that was running
when the run started, with parent/child links taken from LangChain's run ids. Runs LangChain
marks hidden (LangGraph's internal plumbing) are skipped; their children hang on the nearest
recorded ancestor. Tool spans carry the tool's input and output and end ``error`` when the tool
failed. Spans reach the store with the attempt's result, like every span of a rollout. The
rollout is found from context only (a child run's is its parent's, else the context
variables'); runs that end after their rollout finished are not recorded.

One handler serves any number of concurrent rollouts. :func:`instrument` attaches it to every
LangChain run in the process (:func:`~voltrl.adapters.langchain.chat_model` calls it); to attach
it to one call only, pass ``config=tracing_config()``.
"""

from __future__ import annotations

import contextvars
import threading
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import BaseMessage, ToolMessage
from langchain_core.outputs import LLMResult
from langchain_core.runnables import RunnableConfig
from langchain_core.tracers.context import register_configure_hook

from voltrl.tracing import RolloutContext, find_rollout
from voltrl.types import Span, now

#: Longest text kept in a span attribute (tool input/output, model output).
MAX_TEXT = 4000
_HIDDEN = "langsmith:hidden"


@dataclass
class _Open:
    """A run that started and has not ended: its rollout, and its span unless it is hidden
    (then ``parent_id`` is the span its children hang on)."""

    ctx: RolloutContext
    span: Span | None
    parent_id: str | None


def agent_name_from(metadata: Mapping[str, Any] | None) -> str | None:
    """The agent a LangChain run belongs to, from its metadata: the ``create_agent`` agent's
    name (``lc_agent_name``), else the LangGraph node running it (``langgraph_node``)."""
    if not metadata:
        return None
    name = metadata.get("lc_agent_name") or metadata.get("langgraph_node")
    return str(name) if name else None


def _text(value: Any) -> str:
    if isinstance(value, BaseMessage):
        value = value.content
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "…"


def _name(serialized: dict[str, Any] | None, kwargs: dict[str, Any], default: str) -> str:
    name = kwargs.get("name") or (serialized or {}).get("name")
    if not name and serialized and serialized.get("id"):
        name = serialized["id"][-1]
    return str(name or default)


class VoltRLCallbackHandler(BaseCallbackHandler):
    """Records LangChain runs as spans of the current rollout (see the module docstring).

    Span names: ``node:<node>`` for LangGraph nodes, ``chain:<name>`` for other chains,
    ``llm:<model class>``, ``tool:<tool>``, ``retriever:<name>``. Attributes include
    ``langchain.run_id``, ``langgraph.node`` / ``langgraph.step``, the agent name of model
    calls (``agent_name``) and, for tools, ``tool.name``, ``tool.input``, ``tool.output``,
    ``tool.call_id``.
    """

    run_inline = True  # cheap and ordered: no executor hop in async code

    def __init__(self) -> None:
        self._open: dict[UUID, _Open] = {}
        self._lock = threading.Lock()

    # ---- bookkeeping --------------------------------------------------------------------
    def _start(
        self,
        run_id: UUID,
        parent_run_id: UUID | None,
        name: str,
        tags: list[str] | None,
        metadata: dict[str, Any] | None,
        attributes: dict[str, Any],
    ) -> None:
        with self._lock:
            parent = self._open.get(parent_run_id) if parent_run_id else None
        ctx = parent.ctx if parent is not None else find_rollout()
        if ctx is None or ctx.finished:
            return
        parent_id = None
        if parent is not None:
            parent_id = parent.span.span_id if parent.span is not None else parent.parent_id
        span = None
        if _HIDDEN not in (tags or []):
            metadata = metadata or {}
            attributes = {"langchain.run_id": str(run_id), **attributes}
            if "langgraph_node" in metadata:
                attributes["langgraph.node"] = metadata["langgraph_node"]
                attributes["langgraph.step"] = metadata.get("langgraph_step")
            span = Span(
                rollout_id=ctx.rollout_id,
                attempt_id=ctx.attempt_id,
                trace_id=ctx.trace_id,
                parent_id=parent_id,
                name=name,
                attributes=attributes,
            )
        with self._lock:
            self._open[run_id] = _Open(ctx, span, parent_id)

    def _end(
        self,
        run_id: UUID,
        error: BaseException | None = None,
        *,
        failed: bool = False,
        **attributes: Any,
    ) -> None:
        with self._lock:
            run = self._open.pop(run_id, None)
        if run is None or run.span is None:
            return
        span = run.span
        span.end_time = now()
        span.attributes.update(attributes)
        span.status = "error" if failed or error is not None else "ok"
        if error is not None:
            span.events.append(
                {
                    "name": "exception",
                    "time": span.end_time,
                    "type": type(error).__name__,
                    "message": str(error),
                    "stacktrace": "".join(traceback.format_exception(error)),
                }
            )
        run.ctx.add_span_if_running(span)

    def _event(self, run_id: UUID, name: str, **attributes: Any) -> None:
        with self._lock:
            run = self._open.get(run_id)
        if run is not None and run.span is not None:
            run.span.events.append({"name": name, "time": now(), "attributes": attributes})

    # ---- chains and LangGraph nodes -------------------------------------------------------
    def on_chain_start(
        self,
        serialized: dict[str, Any] | None,
        inputs: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """A chain, graph or LangGraph node started."""
        name = _name(serialized, kwargs, "chain")
        node = (metadata or {}).get("langgraph_node")
        kind = "node" if node is not None and node == name else "chain"
        self._start(run_id, parent_run_id, f"{kind}:{name}", tags, metadata, {})

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        """A chain ended."""
        self._end(run_id)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        """A chain raised."""
        self._end(run_id, error)

    def on_agent_action(self, action: Any, *, run_id: UUID, **kwargs: Any) -> None:
        """A (legacy) agent chose a tool: an event on its chain's span."""
        self._event(
            run_id, "agent_action", tool=str(action.tool), tool_input=_text(action.tool_input)
        )

    def on_agent_finish(self, finish: Any, *, run_id: UUID, **kwargs: Any) -> None:
        """A (legacy) agent finished: an event on its chain's span."""
        self._event(run_id, "agent_finish", output=_text(finish.return_values))

    # ---- models ---------------------------------------------------------------------------
    def on_chat_model_start(
        self,
        serialized: dict[str, Any] | None,
        messages: list[list[BaseMessage]],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """A chat model call started."""
        self._model_start(serialized, run_id, parent_run_id, tags, metadata, kwargs)

    def on_llm_start(
        self,
        serialized: dict[str, Any] | None,
        prompts: list[str],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """A text completion call started."""
        self._model_start(serialized, run_id, parent_run_id, tags, metadata, kwargs)

    def _model_start(
        self,
        serialized: dict[str, Any] | None,
        run_id: UUID,
        parent_run_id: UUID | None,
        tags: list[str] | None,
        metadata: dict[str, Any] | None,
        kwargs: dict[str, Any],
    ) -> None:
        params = kwargs.get("invocation_params") or {}
        attributes: dict[str, Any] = {
            "llm.model": params.get("model") or params.get("model_name"),
            "agent_name": agent_name_from(metadata),
        }
        name = _name(serialized, kwargs, "llm")
        self._start(run_id, parent_run_id, f"llm:{name}", tags, metadata, attributes)

    def on_llm_end(self, response: LLMResult, *, run_id: UUID, **kwargs: Any) -> None:
        """A model call ended: its first generation's text and tool calls."""
        attributes: dict[str, Any] = {}
        generations = [g for gs in response.generations for g in gs]
        if generations:
            first = generations[0]
            attributes["llm.output"] = _text(first.text)
            message = getattr(first, "message", None)
            tool_calls = getattr(message, "tool_calls", None)
            if tool_calls:
                attributes["llm.tool_calls"] = [str(c.get("name")) for c in tool_calls]
        self._end(run_id, **attributes)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        """A model call raised."""
        self._end(run_id, error)

    # ---- tools and retrievers ---------------------------------------------------------------
    def on_tool_start(
        self,
        serialized: dict[str, Any] | None,
        input_str: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """A tool started."""
        name = _name(serialized, kwargs, "tool")
        attributes = {
            "tool.name": name,
            "tool.input": _text(input_str),
            "tool.call_id": kwargs.get("tool_call_id"),
        }
        self._start(run_id, parent_run_id, f"tool:{name}", tags, metadata, attributes)

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        """A tool returned; a tool error the tool handled itself (``ToolMessage`` with status
        ``error``) ends the span ``error`` too."""
        failed = isinstance(output, ToolMessage) and output.status == "error"
        self._end(run_id, failed=failed, **{"tool.output": _text(output)})

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        """A tool raised."""
        self._end(run_id, error, **{"tool.output": _text(str(error))})

    def on_retriever_start(
        self,
        serialized: dict[str, Any] | None,
        query: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """A retriever started."""
        name = _name(serialized, kwargs, "retriever")
        attributes = {"retriever.query": _text(query)}
        self._start(run_id, parent_run_id, f"retriever:{name}", tags, metadata, attributes)

    def on_retriever_end(self, documents: Any, *, run_id: UUID, **kwargs: Any) -> None:
        """A retriever returned."""
        self._end(run_id, **{"retriever.documents": len(documents)})

    def on_retriever_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        """A retriever raised."""
        self._end(run_id, error)


_handler = VoltRLCallbackHandler()
# Read by LangChain's configure hook once instrument() registered it; the default makes it
# hold in every thread and task.
_auto: contextvars.ContextVar[VoltRLCallbackHandler | None] = contextvars.ContextVar(
    "voltrl_langchain_handler", default=_handler
)
_instrumented = False


def callback_handler() -> VoltRLCallbackHandler:
    """The process's shared handler (it serves every rollout)."""
    return _handler


def tracing_config(config: RunnableConfig | None = None) -> RunnableConfig:
    """``config`` (or a new one) with the shared handler added to its callbacks:
    ``graph.ainvoke(inputs, config=tracing_config({"recursion_limit": 20}))``."""
    config = RunnableConfig(**(config or {}))
    callbacks = config.get("callbacks")
    if callbacks is None:
        config["callbacks"] = [_handler]
    elif isinstance(callbacks, list):
        if _handler not in callbacks:
            config["callbacks"] = [*callbacks, _handler]
    else:  # a callback manager
        callbacks.add_handler(_handler, inherit=True)
    return config


def instrument() -> VoltRLCallbackHandler:
    """Attach the shared handler to every LangChain run in this process from now on (runs
    outside a rollout are ignored), so agents need no ``config`` change. Idempotent."""
    global _instrumented
    if not _instrumented:
        register_configure_hook(_auto, True, VoltRLCallbackHandler)
        _instrumented = True
    return _handler
