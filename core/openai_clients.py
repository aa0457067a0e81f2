"""OpenAI clients for an :class:`~voltrl.LLM` that share their connections: what
:meth:`LLM.openai_client <voltrl.LLM.openai_client>` hands agents and every adapter builds on.

An agent builds its client in each rollout. A default ``AsyncOpenAI`` is expensive to build:
its TLS context reads the CA certificates (40 ms of CPU on an idle machine, 200 ms under
training load), on the event loop that runs every other rollout, and it opens new connections
to the gateway for each rollout. The clients made here cost about 50 µs and reuse connections:

- every client shares one TLS context (:func:`ssl_context`);
- an async client sends through the connections of the event loop it is used on (per loop,
  for every endpoint: connections are kept per host, in :data:`SHARDS` pools that clients take
  in turn). The client itself holds nothing bound to a loop, so it works from any loop,
  including ``asyncio.run`` per rollout in threads. A loop's pools close when the loop shuts
  down (``asyncio.run``, ``asyncio.Runner``, uvloop: ``shutdown_asyncgens``); pools of loops
  that closed without it are dropped when the next loop gets one;
- sync clients share one pool per process, closed at exit;
- closing a client (``await client.close()``, ``async with client``) closes that client only,
  never the pool other rollouts use.

Each client keeps its own base URL and API key (a rollout-scoped LLM's endpoint names its
rollout and attempt; ``agent_name`` adds the agent) and tags each request with the gateway's
headers for the rollout running at request time (:func:`call_headers`), so a client built once
and shared by concurrent rollouts records each call against its own rollout. Context variables
follow asyncio tasks and ``asyncio.to_thread``.

``openai`` is an optional dependency of voltrl: this module needs it; the core imports it only
when a client is asked for.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import functools
import itertools
import os
import ssl
import threading
import weakref
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass, field

import httpx2
from openai import AsyncOpenAI, OpenAI

from voltrl._http import CLIENT_KEEPALIVE_S
from voltrl.resources import LLM
from voltrl.tracing import rollout_headers

#: The pools' limits: enough connections for a runner's concurrent rollouts, kept between turns.
LIMITS = httpx2.Limits(
    max_connections=1000, max_keepalive_connections=256, keepalive_expiry=CLIENT_KEEPALIVE_S
)
#: A loop's connections are split over this many pools, each client using one (in turn): a pool
#: looks at every connection and queued request of its own each time a request starts or ends,
#: so one pool of 192 connections cost more CPU than it saved (benchmarks/client_start.py).
SHARDS = 16
SHARD_LIMITS = httpx2.Limits(
    max_connections=LIMITS.max_connections // SHARDS,
    max_keepalive_connections=LIMITS.max_keepalive_connections // SHARDS,
    keepalive_expiry=LIMITS.keepalive_expiry,
)

_extra: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "voltrl_request_headers", default=None
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


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """The TLS context of every client made here: ``httpx2``'s default (the system's CA
    certificates, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` as set when first called), built
    once per process. Clients share it: configure none of them through it (an HTTP/2 client
    or a client certificate needs a context of its own)."""
    return httpx2.create_ssl_context()


@dataclass(eq=False)
class _LoopPool:
    """The connection pools of one event loop (:data:`SHARDS`), closed at its shutdown."""

    loop: weakref.ref[asyncio.AbstractEventLoop]
    shards: list[httpx2.AsyncHTTPTransport] = field(
        default_factory=lambda: [
            httpx2.AsyncHTTPTransport(verify=ssl_context(), limits=SHARD_LIMITS)
            for _ in range(SHARDS)
        ]
    )
    closed: bool = False
    # Held here: the loop keeps its async generators in a weak set.
    closer: AsyncGenerator[None, None] | None = None

    def close_at_shutdown(self) -> None:
        """Start :meth:`_closing` on the running loop, which registers it as one of the loop's
        async generators: ``shutdown_asyncgens`` closes it, and so the pool, on the loop."""
        self.closer = agen = self._closing()
        with contextlib.suppress(StopIteration):
            agen.__anext__().send(None)  # runs to the yield without awaiting anything

    async def _closing(self) -> AsyncGenerator[None, None]:
        try:
            yield
        finally:
            if not self.closed:
                self.closed = True
                _forget(self)
                for shard in self.shards:
                    await shard.aclose()

    def drop(self) -> None:
        """Let go of the pool of a loop that closed without shutting down its async
        generators (its sockets close as they are collected)."""
        self.closed = True
        if self.closer is not None:  # finished here, so never handed to its closed loop
            with contextlib.suppress(StopIteration, RuntimeError):
                self.closer.aclose().send(None)


_pools: dict[int, _LoopPool] = {}
_pools_lock = threading.Lock()


def _forget(pool: _LoopPool) -> None:
    with _pools_lock:
        for key, known in list(_pools.items()):
            if known is pool:
                del _pools[key]


def _loop_transport(shard: int) -> httpx2.AsyncHTTPTransport:
    """One of the running loop's connection pools, made on first use."""
    loop = asyncio.get_running_loop()
    pool = _pools.get(id(loop))
    if pool is not None and pool.loop() is loop and not pool.closed:
        return pool.shards[shard]
    with _pools_lock:
        for key, known in list(_pools.items()):
            other = known.loop()
            if other is None or other.is_closed() or known.closed:
                del _pools[key]
                known.drop()
        pool = _LoopPool(weakref.ref(loop))
        _pools[id(loop)] = pool
    pool.close_at_shutdown()
    return pool.shards[shard]


class _LoopTransport(httpx2.AsyncBaseTransport):
    """Sends each request through the pool of the loop it is sent on (this client's shard of
    it, so a rollout's calls find its own warm connections); closing it leaves the pool open."""

    _next = itertools.count()

    def __init__(self) -> None:
        self.shard = next(self._next) % SHARDS

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        return await _loop_transport(self.shard).handle_async_request(request)


_sync_pools: dict[int, httpx2.HTTPTransport] = {}  # by process id: a fork makes its own


@atexit.register
def _close_sync_pools() -> None:
    for pool in _sync_pools.values():
        pool.close()


class _ProcessTransport(httpx2.BaseTransport):
    """Sends each request through the process's sync pool; closing it leaves the pool open."""

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        pool = _sync_pools.get(os.getpid())
        if pool is None:
            with _pools_lock:
                pool = _sync_pools.setdefault(
                    os.getpid(), httpx2.HTTPTransport(verify=ssl_context(), limits=LIMITS)
                )
        return pool.handle_request(request)


_PROCESS_TRANSPORT = _ProcessTransport()


def async_http_client(
    agent_name: str | None = None, *, timeout: float = 600.0
) -> httpx2.AsyncClient:
    """An ``httpx2.AsyncClient`` on the shared pools, for frameworks that build their own
    ``AsyncOpenAI`` and take an ``http_client``: each request gets :func:`call_headers`.
    Closing it leaves the pools open."""

    async def tag(request: httpx2.Request) -> None:
        for key, value in call_headers(agent_name).items():
            request.headers.setdefault(key, value)

    return httpx2.AsyncClient(
        transport=_LoopTransport(),
        verify=ssl_context(),  # a proxy from the environment gets a transport of its own
        timeout=timeout,
        event_hooks={"request": [tag]},
    )


def sync_http_client(agent_name: str | None = None, *, timeout: float = 600.0) -> httpx2.Client:
    """The sync form of :func:`async_http_client`, on the process's pool."""

    def tag(request: httpx2.Request) -> None:
        for key, value in call_headers(agent_name).items():
            request.headers.setdefault(key, value)

    return httpx2.Client(
        transport=_PROCESS_TRANSPORT,
        verify=ssl_context(),
        timeout=timeout,
        event_hooks={"request": [tag]},
    )


def async_openai(
    llm: LLM, agent_name: str | None = None, *, timeout: float = 600.0, max_retries: int = 2
) -> AsyncOpenAI:
    """An ``openai.AsyncOpenAI`` client for ``llm`` on the shared pools, tagging each call
    with the rollout (see the module's docstring)."""
    return AsyncOpenAI(
        base_url=endpoint_for(llm, agent_name),
        api_key=llm.api_key,
        http_client=async_http_client(agent_name, timeout=timeout),
        max_retries=max_retries,
    )


def sync_openai(
    llm: LLM, agent_name: str | None = None, *, timeout: float = 600.0, max_retries: int = 2
) -> OpenAI:
    """The sync form of :func:`async_openai`."""
    return OpenAI(
        base_url=endpoint_for(llm, agent_name),
        api_key=llm.api_key,
        http_client=sync_http_client(agent_name, timeout=timeout),
        max_retries=max_retries,
    )
