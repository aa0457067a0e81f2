"""LangChain's ``ChatOpenAI`` built from a :class:`voltrl.LLM`, on chat-completions.

The model's OpenAI clients come from :mod:`voltrl.adapters.openai_client`, so one model shared
by concurrent rollouts still records every call against the rollout that made it. Calls are
attributed to an agent: the ``agent_name`` given here, else the ``create_agent(name=...)`` agent
or the LangGraph node that makes the call (read from the run's metadata), so a trajectory
config's ``agent_filter`` can pick the nodes to train.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.messages import BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import ensure_config
from langchain_openai import ChatOpenAI

from voltrl.adapters.langchain.callbacks import agent_name_from, instrument
from voltrl.adapters.openai_client import async_openai, endpoint_for, sync_openai
from voltrl.resources import LLM

#: Sampling parameters that are ``ChatOpenAI`` fields, by the name ``ChatOpenAI`` gives them.
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "stop": "stop",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "n": "n",
    "logprobs": "logprobs",
    "top_logprobs": "top_logprobs",
}


def sampling_fields(llm: LLM) -> dict[str, Any]:
    """The LLM's sampling parameters as ``ChatOpenAI`` arguments; parameters that are no
    ``ChatOpenAI`` field (``top_k``, ``min_p``, ...) travel in ``extra_body``."""
    fields: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in llm.sampling_parameters.items():
        if key in _FIELDS:
            fields[_FIELDS[key]] = value
        else:
            extra[key] = value
    if extra:
        fields["extra_body"] = extra
    return fields


class GatewayChatOpenAI(ChatOpenAI):
    """``ChatOpenAI`` that names the agent of each call to VoltRL's gateway.

    With ``voltrl_agent_name`` unset, each call carries an ``x-agent-name`` header taken from
    the run's metadata (:func:`agent_name_from`: the LangGraph node or ``create_agent`` name);
    otherwise the client already names the agent.
    """

    voltrl_agent_name: str | None = None
    """The fixed agent name of every call (None: from the LangGraph node)."""

    voltrl_gateway: bool = True
    """Whether the endpoint is a VoltRL gateway (only then are agent headers sent)."""

    def _with_agent(
        self,
        run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
    ) -> dict[str, Any]:
        if self.voltrl_agent_name or not self.voltrl_gateway:
            return kwargs
        # LangChain hands streaming calls no run manager; the config of the runnable running
        # now (the LangGraph node, in a context variable) has the same metadata.
        metadata = {**(ensure_config().get("metadata") or {})}
        if run_manager is not None:
            metadata.update(run_manager.metadata)
        name = agent_name_from(metadata)
        if not name:
            return kwargs
        headers = {"x-agent-name": name, **(kwargs.get("extra_headers") or {})}
        return {**kwargs, "extra_headers": headers}

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return super()._generate(
            messages, stop, run_manager, **self._with_agent(run_manager, kwargs)
        )

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await super()._agenerate(
            messages, stop, run_manager, **self._with_agent(run_manager, kwargs)
        )

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        return super()._stream(messages, stop, run_manager, **self._with_agent(run_manager, kwargs))

    def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        return super()._astream(
            messages, stop, run_manager, **self._with_agent(run_manager, kwargs)
        )


def chat_model(
    llm: LLM,
    agent_name: str | None = None,
    *,
    timeout: float = 600.0,
    max_retries: int = 2,
    **kwargs: Any,
) -> ChatOpenAI:
    """A LangChain ``ChatOpenAI`` for ``llm`` (chat-completions, never the Responses API).

    Args:
        llm: the resource a rollout received (rollout-scoped), or a gateway LLM shared by
            concurrent rollouts (each call then names its rollout in headers).
        agent_name: the agent every call is recorded under; None names each call after the
            ``create_agent`` agent or LangGraph node making it.
        timeout, max_retries: of the underlying OpenAI clients.
        kwargs: any other ``ChatOpenAI`` argument; they override the LLM's sampling parameters.

    It also calls :func:`~voltrl.adapters.langchain.instrument`, so every LangChain run of a
    rollout in this process (graph, nodes, model and tool calls) is recorded as a span.
    """
    instrument()
    sync_client = sync_openai(llm, agent_name=agent_name, timeout=timeout, max_retries=max_retries)
    async_client = async_openai(
        llm, agent_name=agent_name, timeout=timeout, max_retries=max_retries
    )
    return GatewayChatOpenAI(
        model=llm.model,
        api_key=llm.api_key,
        base_url=endpoint_for(llm, agent_name),
        root_client=sync_client,
        client=sync_client.chat.completions,
        root_async_client=async_client,
        async_client=async_client.chat.completions,
        use_responses_api=False,
        max_retries=max_retries,
        voltrl_agent_name=agent_name,
        voltrl_gateway=llm.gateway,
        **{**sampling_fields(llm), **kwargs},
    )
