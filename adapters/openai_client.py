"""OpenAI clients pointed at VoltRL's gateway, the building block of every framework adapter.

All four supported frameworks talk to the model through the ``openai`` package's client. The
clients made here carry the rollout to the gateway in one of two ways:

- a rollout-scoped :class:`~voltrl.LLM` (what an agent receives inside a rollout) already has
  the rollout and attempt ids in its endpoint, so every call is recorded against it;
- a client made once and shared (built from an unscoped gateway LLM, or living in a service)
  adds the gateway's header form on each request, read at request time from the current
  rollout (:func:`voltrl.rollout_headers`) and from :func:`request_headers` blocks. Context
  variables follow asyncio tasks and ``asyncio.to_thread``, so concurrent rollouts sharing one
  client never mix their calls.

Every client made here shares one TLS context (:func:`ssl_context`): an agent that builds its
client in each rollout, as framework agents do, would otherwise read the CA certificates again
for each one (about 50 ms of CPU, longer than a small model's whole rollout).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import ssl
from collections.abc import Iterator, Mapping
from typing import Any

import httpx2
from openai import AsyncOpenAI, OpenAI

from voltrl.resources import LLM
from voltrl.tracing import rollout_headers

_extra: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "voltrl_request_headers", default=None
)

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


@contextlib.contextmanager
def request_headers(headers: Mapping[str, str]) -> Iterator[None]:
    """Send ``headers`` with every call our clients make inside this block (this task or
    thread only), e.g. ``with request_headers({"x-rollout-id": trace_id}): ...`` in a service
    that serves rollouts for a trainer elsewhere."""
    token = _extra.set({**(_extra.get() or {}), **headers})
    try:
        yield
    finally:
        _extra.reset(token)


def call_headers(agent_name: str | None = None) -> dict[str, str]:
    """The headers a call made here and now carries: the current rollout's, then any set by
    :func:`request_headers` (which win)."""
    return {**rollout_headers(agent_name), **(_extra.get() or {})}


def endpoint_for(llm: LLM, agent_name: str | None = None) -> str:
    """The base URL for ``llm``, attributed to ``agent_name`` when it is rollout-scoped."""
    return (llm.for_agent(agent_name) if agent_name else llm).endpoint


def sampling_kwargs(llm: LLM) -> dict[str, Any]:
    """The LLM's sampling parameters that chat-completions takes as named arguments."""
    return {k: v for k, v in llm.sampling_parameters.items() if k in SAMPLING_KEYS}


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """The TLS context of every client made here: ``httpx2``'s default (the system's CA
    certificates, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` as set when first called), built
    once per process. Clients share it: configure none of them through it (an HTTP/2 client
    or a client certificate needs a context of its own)."""
    return httpx2.create_ssl_context()


def _hook(agent_name: str | None) -> Any:
    def add(request: httpx2.Request) -> None:
        for key, value in call_headers(agent_name).items():
            request.headers.setdefault(key, value)

    async def add_async(request: httpx2.Request) -> None:
        add(request)

    return add, add_async


def async_http_client(
    agent_name: str | None = None, *, timeout: float = 600.0
) -> httpx2.AsyncClient:
    """The ``httpx2.AsyncClient`` behind :func:`async_openai`, for frameworks that build their
    own ``AsyncOpenAI`` and take an ``http_client``: each request gets :func:`call_headers`."""
    _, add_async = _hook(agent_name)
    return httpx2.AsyncClient(
        timeout=timeout, verify=ssl_context(), event_hooks={"request": [add_async]}
    )


def async_openai(
    llm: LLM, *, agent_name: str | None = None, timeout: float = 600.0, max_retries: int = 2
) -> AsyncOpenAI:
    """An ``openai.AsyncOpenAI`` client for ``llm`` that tags calls with the rollout."""
    http = async_http_client(agent_name, timeout=timeout)
    return AsyncOpenAI(
        base_url=endpoint_for(llm, agent_name),
        api_key=llm.api_key,
        http_client=http,
        max_retries=max_retries,
    )


def sync_openai(
    llm: LLM, *, agent_name: str | None = None, timeout: float = 600.0, max_retries: int = 2
) -> OpenAI:
    """An ``openai.OpenAI`` client for ``llm`` that tags calls with the rollout."""
    add, _ = _hook(agent_name)
    http = httpx2.Client(timeout=timeout, verify=ssl_context(), event_hooks={"request": [add]})
    return OpenAI(
        base_url=endpoint_for(llm, agent_name),
        api_key=llm.api_key,
        http_client=http,
        max_retries=max_retries,
    )
