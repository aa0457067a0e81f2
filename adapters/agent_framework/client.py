"""Agent Framework's chat-completions client for a VoltRL :class:`~voltrl.LLM`.

``agent_framework.openai.OpenAIChatClient`` calls the Responses API (``/v1/responses``), which
the gateway neither serves nor records. :func:`chat_client` builds ``OpenAIChatCompletionClient``
(``/v1/chat/completions``) instead, on the rollout-tagging ``AsyncOpenAI`` of
:mod:`voltrl.adapters.openai_client`, and applies the LLM's sampling parameters to every model
call unless the agent or the call sets them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from agent_framework import ChatContext, ChatMiddleware
from agent_framework.openai import OpenAIChatCompletionClient

from voltrl.adapters.openai_client import async_openai
from voltrl.resources import LLM

#: Sampling parameters that Agent Framework's ``ChatOptions`` takes by these names.
CHAT_OPTION_KEYS = (
    "temperature",
    "top_p",
    "max_tokens",
    "stop",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
)


def chat_options(llm: LLM) -> dict[str, Any]:
    """The LLM's sampling parameters as Agent Framework chat options (``default_options``).

    ``max_completion_tokens`` becomes ``max_tokens`` (the framework sends it back as
    ``max_completion_tokens``); parameters chat options have no name for (``top_k``,
    ``repetition_penalty``...) go in ``extra_body``, as vLLM takes them.
    """
    params = dict(llm.sampling_parameters)
    if "max_completion_tokens" in params:
        params.setdefault("max_tokens", params.pop("max_completion_tokens"))
    options = {k: v for k, v in params.items() if k in CHAT_OPTION_KEYS}
    extra = {k: v for k, v in params.items() if k not in CHAT_OPTION_KEYS}
    if extra:
        options["extra_body"] = extra
    return options


class SamplingDefaults(ChatMiddleware):
    """Chat middleware that fills in sampling options a model call does not set itself."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = dict(options)

    async def process(self, context: ChatContext, call_next: Callable[[], Awaitable[None]]) -> None:
        """Merge the defaults under the call's own options, then run the call."""
        given = {k: v for k, v in (context.options or {}).items() if v is not None}
        context.options = {**self.options, **given}
        await call_next()


def chat_client(
    llm: LLM, agent_name: str | None = None, **kwargs: Any
) -> OpenAIChatCompletionClient[Any]:
    """An Agent Framework ``OpenAIChatCompletionClient`` for ``llm``.

    Calls go to the LLM's endpoint (the rollout's gateway URL inside a rollout) with the
    rollout's headers added at request time, so one client may be shared by concurrent
    rollouts. ``agent_name`` attributes the calls to one agent of a multi-agent system (the
    trainer's agent filter selects on it). The LLM's sampling parameters apply to every call
    unless the agent's ``default_options`` or the call's ``options`` set them. ``kwargs`` go to
    ``OpenAIChatCompletionClient`` (``middleware``, ``instruction_role``...).
    """
    middleware = [SamplingDefaults(chat_options(llm)), *(kwargs.pop("middleware", None) or ())]
    return OpenAIChatCompletionClient(
        model=llm.model,
        async_client=async_openai(llm, agent_name=agent_name),
        middleware=middleware,
        **kwargs,
    )
