"""OpenAI clients pointed at VoltRL's gateway, the building block of every framework adapter.

All supported frameworks talk to the model through the ``openai`` package's client. The clients
are :mod:`voltrl.openai_clients`' (what :meth:`voltrl.LLM.openai_client` hands agents), named
here for the adapters: they cost microseconds to build, share the event loop's connections
and one TLS context, and carry the rollout to the gateway in one of two ways:

- a rollout-scoped :class:`~voltrl.LLM` (what an agent receives inside a rollout) already has
  the rollout and attempt ids in its endpoint, so every call is recorded against it;
- a client made once and shared (built from an unscoped gateway LLM, or living in a service)
  adds the gateway's header form on each request, read at request time from the current
  rollout (:func:`voltrl.rollout_headers`) and from :func:`request_headers` blocks.

Closing one of them (frameworks close their clients at the end of a rollout) never closes the
connections the others use.
"""

from __future__ import annotations

from typing import Any

from voltrl.openai_clients import (
    async_http_client,
    async_openai,
    call_headers,
    endpoint_for,
    request_headers,
    ssl_context,
    sync_http_client,
    sync_openai,
)
from voltrl.resources import LLM

__all__ = [
    "SAMPLING_KEYS",
    "async_http_client",
    "async_openai",
    "call_headers",
    "endpoint_for",
    "request_headers",
    "sampling_kwargs",
    "ssl_context",
    "sync_http_client",
    "sync_openai",
]

#: Sampling parameters that chat-completions accepts by these names.
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "n",
)


def sampling_kwargs(llm: LLM) -> dict[str, Any]:
    """The LLM's sampling parameters that chat-completions takes as named arguments."""
    return {k: v for k, v in llm.sampling_parameters.items() if k in SAMPLING_KEYS}
