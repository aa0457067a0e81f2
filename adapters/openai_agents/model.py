"""The OpenAI Agents SDK's chat-completions model, built from a :class:`~voltrl.LLM`.

The SDK's default provider talks to the Responses API (``/v1/responses``), which the gateway
does not serve (it records chat-completions with their token ids); :func:`model` returns the
SDK's :class:`~agents.OpenAIChatCompletionsModel` on one of our rollout-tagging OpenAI clients
instead:

- calls carry the current rollout (a rollout-scoped endpoint, or the gateway's headers read at
  request time), so one model object is safe for concurrent rollouts;
- the LLM's sampling parameters apply to every call (they win over the agent's
  ``model_settings``: the algorithm decides how a rollout samples);
- each call is attributed to an agent: the ``agent_name`` given here, else the name of the SDK
  agent that is running (so handoffs between agents sharing one model are told apart);
- the first model made in a process installs :func:`~.tracing.install_tracing` (unless
  ``tracing=False``): runner processes record the SDK's spans and never export them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any

from agents import ModelSettings, OpenAIChatCompletionsModel
from agents.agent_output import AgentOutputSchemaBase
from agents.handoffs import Handoff
from agents.items import ModelResponse, TResponseInputItem, TResponseStreamEvent
from agents.models.interface import ModelTracing
from agents.tool import Tool
from agents.tracing import AgentSpanData, TurnSpanData, get_current_span
from openai.types.responses.response_prompt_param import ResponsePromptParam

from voltrl.adapters.openai_agents.tracing import ensure_tracing
from voltrl.adapters.openai_client import SAMPLING_KEYS, async_openai
from voltrl.resources import LLM

#: Sampling parameters that ``ModelSettings`` has a field for; the others go to ``extra_args``.
_SETTINGS_FIELDS = ("temperature", "top_p", "max_tokens", "presence_penalty", "frequency_penalty")


def model_settings(llm: LLM | Mapping[str, Any]) -> ModelSettings:
    """An LLM's sampling parameters (or such parameters themselves, e.g. ones a service
    received with a request) as the SDK's ``ModelSettings``; ``stop``, ``seed``,
    ``max_completion_tokens``... travel in ``extra_args``. ``n`` is dropped: the SDK reads one
    choice per call."""
    given = llm.sampling_parameters if isinstance(llm, LLM) else llm
    params = {k: v for k, v in given.items() if k in SAMPLING_KEYS and k != "n"}
    named = {k: params.pop(k) for k in _SETTINGS_FIELDS if k in params}
    return ModelSettings(**named, extra_args=params or None)


def running_agent_name() -> str | None:
    """The name of the SDK agent whose turn is running here (from the SDK's current span,
    which the runner sets even when tracing is disabled), or None."""
    span = get_current_span()
    data = span.span_data if span is not None else None
    if isinstance(data, TurnSpanData):
        return data.agent_name
    if isinstance(data, AgentSpanData):
        return data.name
    return None


class VoltRLChatCompletionsModel(OpenAIChatCompletionsModel):
    """``OpenAIChatCompletionsModel`` that applies a VoltRL LLM's sampling parameters and names
    the calling agent to the gateway. Build it with :func:`model`."""

    def __init__(
        self,
        llm: LLM,
        *,
        agent_name: str | None = None,
        timeout: float = 600.0,
        tracing: bool = True,
    ) -> None:
        if tracing:
            ensure_tracing()
        super().__init__(
            model=llm.model,
            openai_client=async_openai(llm, agent_name=agent_name, timeout=timeout),
        )
        self.llm = llm
        self.agent_name = agent_name
        self.settings = model_settings(llm)

    async def aclose(self) -> None:
        """Close the model's HTTP client."""
        await self._client.close()

    def _settings(self, agent_settings: ModelSettings) -> ModelSettings:
        """The agent's settings, overlaid with the LLM's sampling parameters and, when this
        model has no fixed agent name, the running SDK agent's name as a header."""
        settings = agent_settings.resolve(self.settings)
        name = None if self.agent_name else running_agent_name()
        if name:
            headers = {**(settings.extra_headers or {}), "x-agent-name": name}
            settings = dataclasses.replace(settings, extra_headers=headers)
        return settings

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        previous_response_id: str | None = None,
        conversation_id: str | None = None,
        prompt: ResponsePromptParam | None = None,
    ) -> ModelResponse:
        """The SDK's chat-completions call, with this model's settings and agent name."""
        return await super().get_response(
            system_instructions=system_instructions,
            input=input,
            model_settings=self._settings(model_settings),
            tools=tools,
            output_schema=output_schema,
            handoffs=handoffs,
            tracing=tracing,
            previous_response_id=previous_response_id,
            conversation_id=conversation_id,
            prompt=prompt,
        )

    def stream_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        previous_response_id: str | None = None,
        conversation_id: str | None = None,
        prompt: ResponsePromptParam | None = None,
    ) -> AsyncIterator[TResponseStreamEvent]:
        """The SDK's streamed chat-completions call, with this model's settings and agent
        name (resolved now, while the calling agent's span is current)."""
        return super().stream_response(
            system_instructions=system_instructions,
            input=input,
            model_settings=self._settings(model_settings),
            tools=tools,
            output_schema=output_schema,
            handoffs=handoffs,
            tracing=tracing,
            previous_response_id=previous_response_id,
            conversation_id=conversation_id,
            prompt=prompt,
        )


def model(
    llm: LLM, agent_name: str | None = None, *, timeout: float = 600.0, tracing: bool = True
) -> VoltRLChatCompletionsModel:
    """The SDK model for ``llm``: ``Agent(name=..., model=model(llm), tools=[...])``.

    Chat-completions (not the Responses API), on a client that tags each call with the
    current rollout, so one model object may serve concurrent rollouts. ``agent_name``
    attributes every call to that name; without it, calls are attributed to the SDK agent
    making them. Unless ``tracing=False``, the SDK's tracing is routed into the rollout (see
    :func:`~voltrl.adapters.openai_agents.install_tracing`) the first time in a process.
    """
    return VoltRLChatCompletionsModel(llm, agent_name=agent_name, timeout=timeout, tracing=tracing)
