"""Run an ASGI app (the store server, the gateway, or both) with uvicorn on loopback.

Two ways, both binding the socket first (``port=0`` picks a free port) and returning only once
the server accepts requests:

- :func:`serve` runs the server on the *running* event loop. The trainer uses it: the store it
  serves is also used by the training loop, and an in-memory store must stay on one loop.
- :func:`serve_in_thread` runs it on its own thread and event loop, for synchronous callers
  and tests whose app is used only through HTTP::

      with serve_in_thread(store_app(store)) as server:
          client = HTTPStore(server.url)

On a loopback address both answer only requests whose ``Host`` is a loopback name
(:mod:`voltrl._http.hosts`, against DNS rebinding).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib.util
import signal
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from types import TracebackType
from typing import Any, TypeVar

import uvicorn
from starlette.types import ASGIApp

from voltrl._http import KEEPALIVE_S
from voltrl._http.hosts import HostCheck, is_loopback
from voltrl.errors import VoltRLError


class _Server(uvicorn.Server):
    """A uvicorn server that calls ``on_started`` once it accepts requests and leaves signals
    alone: the process that runs it decides what SIGINT and SIGTERM do (the trainer's Ctrl-C
    handling, ``voltrl serve``'s clean stop). uvicorn's own handling would stop this server on
    the first Ctrl-C, under a training run still using it, and raise the signal again later."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_started()


def _bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` that a later server may bind again at once.

    Created with ``proto=IPPROTO_TCP``: asyncio sets ``TCP_NODELAY`` only on accepted sockets
    whose proto says TCP, and without it every response waits ~40 ms for a delayed ACK.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def check_bindable(host: str, port: int) -> None:
    """Raise :func:`cannot_listen`'s :class:`VoltRLError` if ``host:port`` cannot be bound now
    (e.g. the port is in use): what a command checks before it loads or opens anything."""
    try:
        _bind(host, port).close()
    except OSError as exc:
        raise cannot_listen(host, port, exc) from None


def cannot_listen(host: str, port: int, exc: OSError) -> VoltRLError:
    """The one-line error of a command whose server cannot bind ``host:port``; a port in use
    says so and that ``--port 0`` picks a free one (each command that binds has ``--port``)."""
    if exc.errno == errno.EADDRINUSE:
        reason = "the port is in use (--port 0 picks a free one)"
    else:
        reason = exc.strerror or str(exc)
    return VoltRLError(f"cannot listen on {host}:{port}: {reason}")


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def reachable_url(url: str) -> str:
    """``url`` of a server bound to every address (``0.0.0.0``, ``::``) with this machine's
    host name instead, so that other machines can use it; other URLs as they are."""
    for wildcard in ("http://0.0.0.0:", "http://[::]:"):
        if url.startswith(wildcard):
            return f"http://{socket.gethostname()}:{url[len(wildcard) :]}"
    return url


HTTP_PARSER = "httptools" if importlib.util.find_spec("httptools") else "h11"
"""uvicorn's HTTP/1.1 parser: ``httptools`` (C, a core dependency) when importable, else
``h11`` (pure Python, about half of the server's CPU per request in the store benchmark)."""

_T = TypeVar("_T")


def run(main: Coroutine[Any, Any, _T]) -> _T:
    """``asyncio.run(main)``, on a uvloop event loop when uvloop is installed (a core dependency;
    its loop is C, so each request costs the server less CPU), else on asyncio's own.

    What ``voltrl serve`` and ``voltrl gateway`` run their server on; the trainer keeps its loop.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def _config(
    app: ASGIApp, host: str, port: int, log_level: str, graceful_s: float
) -> uvicorn.Config:
    """uvicorn's settings for ``app`` on ``host:port``. On a loopback address the app answers
    only requests for loopback names (:class:`~voltrl._http.hosts.HostCheck`, against DNS
    rebinding): every server of VoltRL starts here, so none is left out. Off loopback a token
    guards the server and clients use whatever name reaches the machine: no Host check."""
    return uvicorn.Config(
        HostCheck(app) if is_loopback(host) else app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=graceful_s,
        timeout_keep_alive=KEEPALIVE_S,
        http=HTTP_PARSER,
    )


async def serve(
    app: ASGIApp,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    log_level: str = "warning",
    graceful_s: float = 2.0,
) -> tuple[str, Callable[[], Awaitable[None]]]:
    """Serve ``app`` on ``host:port`` (``port=0``: a free one) on the running event loop.

    Returns the base URL (``http://127.0.0.1:41234``) and an async ``stop`` that shuts the
    server down; requests still running then get ``graceful_s`` seconds before they are
    cancelled. Raises ``RuntimeError`` if the server cannot start.
    """
    sock = _bind(host, port)
    port = sock.getsockname()[1]
    started = asyncio.Event()
    server = _Server(_config(app, host, port, log_level, graceful_s), started.set)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"uvicorn:{port}")
    ready = asyncio.create_task(started.wait())
    await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if not started.is_set():
        ready.cancel()
        sock.close()
        error = None if task.cancelled() else task.exception()
        raise RuntimeError(f"server on {_url(host, port)} failed to start: {error!r}") from error

    async def stop() -> None:
        server.should_exit = True
        try:
            await task
        finally:
            sock.close()

    return _url(host, port), stop


class BackgroundServer:
    """A uvicorn server for ``app`` on its own thread and event loop.

    The socket is bound in the constructor, so :attr:`url` is known right away, and a stopped
    server's port can be bound again (``SO_REUSEADDR``). :meth:`start` returns once the server
    accepts requests; :meth:`stop` waits for it to end. Requests still running at stop get
    ``graceful_s`` seconds to finish, then are cancelled. Also a context manager.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        graceful_s: float = 2.0,
    ) -> None:
        self._sock = _bind(host, port)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self._started = threading.Event()
        self._server = _Server(
            _config(app, host, self.port, log_level, graceful_s), self._started.set
        )
        self._thread = threading.Thread(target=self._run, name=f"uvicorn:{self.port}", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """Base URL, such as ``http://127.0.0.1:41234``."""
        return _url(self.host, self.port)

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as exc:  # SystemExit on a failed startup included
            self._error = exc
        finally:
            self._sock.close()
            self._started.set()

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        """Start serving; returns once the server accepts requests (raises if it cannot)."""
        self._thread.start()
        if not self._started.wait(timeout_s):
            self.stop()
            raise RuntimeError(f"server on {self.url} did not start within {timeout_s}s")
        if not self._server.started:
            self._thread.join()
            raise RuntimeError(f"server on {self.url} failed to start: {self._error!r}")
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop serving and wait for the server thread to end. Safe to call more than once."""
        self._server.should_exit = True
        if not self._thread.is_alive():
            self._sock.close()  # never started, or already ended (closing twice is harmless)
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"server on {self.url} did not stop within {2 * timeout_s}s")

    def __enter__(self) -> BackgroundServer:
        if self._thread.ident is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def serve_in_thread(
    app: ASGIApp,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    log_level: str = "warning",
    graceful_s: float = 2.0,
) -> BackgroundServer:
    """Serve ``app`` on ``host:port`` (``port=0``: a free one) in a background thread.

    Returns the started :class:`BackgroundServer`: ``url`` is its base URL, ``stop()`` shuts
    it down.
    """
    server = BackgroundServer(app, host=host, port=port, log_level=log_level, graceful_s=graceful_s)
    return server.start()


def require_token_off_loopback(host: str, token: str | None) -> None:
    """Raise :class:`VoltRLError` if ``host`` is not loopback and there is no token."""
    if not token and not is_loopback(host):
        raise VoltRLError(
            f"binding {host} exposes the server beyond this machine: pass --token-file FILE (or "
            "--token) or set VOLTRL_TOKEN, or bind 127.0.0.1"
        )


async def wait_for_signal() -> None:
    """Return on SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


@contextlib.asynccontextmanager
async def served(app: ASGIApp, host: str, port: int, graceful_s: float) -> AsyncIterator[str]:
    """Serve ``app`` on the running loop while the block runs; yields its URL. A port that
    cannot be bound is :func:`cannot_listen`'s :class:`VoltRLError` (for commands)."""
    try:
        url, stop = await serve(app, host, port, graceful_s=graceful_s)
    except OSError as exc:
        raise cannot_listen(host, port, exc) from None
    try:
        yield url
    finally:
        await stop()
