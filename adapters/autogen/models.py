"""AutoGen's own chat-completions model client, built from a :class:`voltrl.LLM`."""

from __future__ import annotations

from typing import Any

from autogen_core.models import ModelFamily, ModelInfo
from autogen_ext.models.openai import OpenAIChatCompletionClient

from voltrl.adapters.autogen.tracing import instrument
from voltrl.adapters.openai_client import SAMPLING_KEYS, async_http_client, endpoint_for
from voltrl.resources import LLM

#: What AutoGen is told about a model it does not know by name (any open-weights model
#: served by vLLM or LocalRL): tools and JSON output on, one leading system message.
DEFAULT_MODEL_INFO = ModelInfo(
    vision=False,
    function_calling=True,
    json_output=True,
    structured_output=True,
    family=ModelFamily.UNKNOWN,
    multiple_system_messages=False,
)

# AutoGen makes exactly one choice per call and rejects ``n``.
_CREATE_KEYS = tuple(k for k in SAMPLING_KEYS if k != "n")


def model_client(
    llm: LLM, agent_name: str | None = None, **kwargs: Any
) -> OpenAIChatCompletionClient:
    """An ``OpenAIChatCompletionClient`` (chat-completions) for ``llm``.

    The LLM's endpoint, model, API key and sampling parameters are used; sampling parameters
    that chat-completions does not name (``top_k``, ``repetition_penalty``, ...) go in the
    request body as vLLM expects them. ``agent_name`` attributes the calls to one agent of a
    multi-agent system (the trajectory builder's agent filter selects on it). ``kwargs`` go to
    ``OpenAIChatCompletionClient`` and win (``model_info``, ``timeout``, ``max_retries``,
    ``default_headers``, ``parallel_tool_calls``, ...).

    Calls are recorded against the current rollout however the client is shared: a
    rollout-scoped LLM carries the rollout in its endpoint, and every request also carries
    the rollout headers of the asyncio task (or thread) that makes it. Building a client also
    calls :func:`~voltrl.adapters.autogen.instrument` (once per process), so AutoGen's spans
    are recorded in every process that runs rollouts.
    """
    instrument()
    sampling = dict(llm.sampling_parameters)
    sampling.pop("n", None)
    create_args = {k: sampling.pop(k) for k in _CREATE_KEYS if k in sampling}
    if sampling:
        create_args["extra_body"] = sampling
    timeout = kwargs.get("timeout") or 600.0
    config: dict[str, Any] = {
        "model": llm.model,
        "base_url": endpoint_for(llm, agent_name),
        "api_key": llm.api_key,
        "model_info": DEFAULT_MODEL_INFO,
        "http_client": async_http_client(agent_name, timeout=timeout),
        **create_args,
        **kwargs,
    }
    return OpenAIChatCompletionClient(**config)
