"""AgentScope's OpenAI chat model for a VoltRL :class:`~voltrl.LLM`.

:func:`chat_model` builds ``agentscope.model.OpenAIChatModel`` on the rollout-tagging HTTP
client of :mod:`voltrl.adapters.openai_client`, with the LLM's sampling parameters, so its calls
are recorded by the gateway against the current rollout, also when one model object serves many
agents and concurrent rollouts. :class:`AgentNames` records each call under the name of the
agent that made it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentscope.credential import OpenAICredential
from agentscope.middleware import MiddlewareBase
from agentscope.model import OpenAIChatModel

from voltrl.adapters.openai_client import async_http_client, endpoint_for, request_headers
from voltrl.resources import LLM

#: Sampling parameters ``OpenAIChatModel.Parameters`` takes (``max_tokens`` is sent as
#: ``max_completion_tokens``); the others go in the request body as they are.
PARAMETER_KEYS = ("temperature", "top_p", "max_tokens")


def model_parameters(sampling: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split sampling parameters into ``OpenAIChatModel.Parameters`` fields and the extra
    request-body fields (``top_k``, ``stop``, ``seed``, ``repetition_penalty``...)."""
    params = dict(sampling)
    if "max_completion_tokens" in params:
        params.setdefault("max_tokens", params.pop("max_completion_tokens"))
    fields = {k: v for k, v in params.items() if k in PARAMETER_KEYS}
    extra = {k: v for k, v in params.items() if k not in PARAMETER_KEYS}
    return fields, extra


def chat_model(
    llm: LLM,
    agent_name: str | None = None,
    *,
    stream: bool = False,
    timeout: float = 600.0,
    **kwargs: Any,
) -> OpenAIChatModel:
    """An AgentScope ``OpenAIChatModel`` for ``llm``.

    Calls go to the LLM's endpoint (the rollout's gateway URL inside a rollout) with the
    rollout's headers added at request time, so one model may be shared by several agents and
    concurrent rollouts. ``agent_name`` attributes every call to one agent; a model shared by
    several agents records each call under its caller's name with :class:`AgentNames` on each
    agent. The LLM's sampling parameters apply to every call. ``stream`` defaults to off (the
    gateway records either). ``kwargs`` go to ``OpenAIChatModel`` (``formatter``,
    ``context_size``, ``max_retries``...).
    """
    fields, extra = model_parameters(llm.sampling_parameters)
    extra = {**extra, **(kwargs.pop("extra_body", None) or {})}
    return OpenAIChatModel(
        credential=OpenAICredential(api_key=llm.api_key, base_url=endpoint_for(llm, agent_name)),
        model=llm.model,
        parameters=OpenAIChatModel.Parameters(**fields),
        stream=stream,
        client_kwargs={"http_client": async_http_client(agent_name, timeout=timeout)},
        extra_body=extra or None,
        **kwargs,
    )


class AgentNames(MiddlewareBase):
    """Agent middleware: each model call of the agent carries its name (``x-agent-name``), so
    agents sharing one model are told apart in the recorded calls. A name the model was built
    with (``chat_model(llm, agent_name=...)``) wins."""

    async def on_model_call(
        self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any
    ) -> Any:
        """Make the call with the agent's name among the request headers."""
        with request_headers({"x-agent-name": agent.name}):
            return await next_handler(**input_kwargs)
