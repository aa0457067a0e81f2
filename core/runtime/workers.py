"""Worker processes: :class:`WorkerPool` runs :func:`~voltrl.runtime.runner.run_worker` in ``n``
processes on this machine, each reaching the store server over HTTP, and restarts one that
dies; :func:`run_runner` is ``voltrl runner``: a pool for a store server anywhere, until
SIGTERM.

Each worker is a plain ``python`` process (:func:`worker_main`), not a multiprocessing child:
it receives its settings and the agent (pickled by value with cloudpickle when it lives in a
script) on its standard input, so it never imports the user's script again (no main guard
needed) and secrets never appear on a command line.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import types
from collections import ChainMap
from collections.abc import Mapping
from typing import Any

import cloudpickle

from voltrl.agent import LitAgent
from voltrl.errors import AgentLoadError
from voltrl.resources import ApiKeys
from voltrl.runtime.runner import RECYCLE_EXIT_CODE, RunnerConfig, run_worker

log = logging.getLogger("voltrl.runtime.runner")

AGENT_LOAD_EXIT_CODE = 78
"""A worker process that could not load the agent exits with this; the pool does not restart
it (a new process would fail the same way)."""

_WORKER_MAIN = "from voltrl.runtime.workers import worker_main; worker_main()"
"""What a worker process runs (``python -c``): it reads its settings from standard input, so
it never imports the script that started it (no ``if __name__ == "__main__"`` guard needed)
and secrets never appear on a command line."""


def worker_main() -> None:
    """Entry point of a worker process started by :class:`WorkerPool`: its settings arrive
    pickled on standard input (store URL, token, the agent pickled by value with cloudpickle
    when it lives in a script, worker id, config, ``sys.path``, API keys). It runs until
    SIGTERM or the death of the process that started it (each stops it gracefully). SIGINT is
    ignored: a Ctrl-C in the terminal reaches the whole process group, and the process that
    started the workers (trainer or ``voltrl runner``) decides how they stop."""
    import pickle

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    settings = pickle.loads(sys.stdin.buffer.read())
    sys.path[:0] = [p for p in settings.pop("sys_path") if p not in sys.path]
    _run_worker_process(**settings)


def _run_worker_process(
    store_url: str,
    token: str | None,
    agent_blob: bytes,
    worker_id: str,
    config: RunnerConfig,
    llm_keys: dict[str, str],
) -> None:
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s [{worker_id}] %(levelname)s %(message)s"
    )
    from voltrl.store.http import HTTPStore

    try:
        agent = cloudpickle.loads(agent_blob)
    except Exception as exc:
        print(
            f"voltrl worker {worker_id}: cannot load the agent: {type(exc).__name__}: {exc} "
            "(is its module importable here: the same directory or PYTHONPATH?)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(AGENT_LOAD_EXIT_CODE)
    parent = os.getppid()

    async def watch_parent(stop: asyncio.Event) -> None:
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        log.warning("worker %s: the process that started it is gone; stopping", worker_id)
        stop.set()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        orphaned = asyncio.create_task(watch_parent(stop))
        store = HTTPStore(store_url, token=token)
        recycle = asyncio.Event()
        try:
            keys = ApiKeys(gateway=token, llms=llm_keys)
            await run_worker(
                store,
                agent,
                worker_id=worker_id,
                config=config,
                stop=stop,
                keys=keys,
                recycle=recycle,
            )
        finally:
            orphaned.cancel()
            await store.close()
        if recycle.is_set():
            # Exit at once: a normal shutdown would wait on threads that may never return.
            os._exit(RECYCLE_EXIT_CODE)

    asyncio.run(main())


def _code_reduce(code: types.CodeType) -> tuple[Any, tuple[Any, ...]]:
    """cloudpickle's reduction of ``code`` with its file name kept: cloudpickle writes
    ``<dynamic-code>`` there, so a traceback in a worker would not name the user's script
    (its line numbers are kept either way)."""
    constructor, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    return constructor, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _AgentPickler(cloudpickle.Pickler):
    """cloudpickle's pickler, but code pickled by value keeps its file name (see
    :func:`_code_reduce`)."""

    dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)


def pickled_agent(agent: LitAgent) -> bytes:
    """``agent`` pickled for worker processes (by value when it lives in a script, so they
    never import the script, with its file names and line numbers, so their tracebacks point
    at it), or an :class:`AgentLoadError` naming what cannot be sent."""
    try:
        buffer = io.BytesIO()
        _AgentPickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(agent)
        return buffer.getvalue()
    except Exception as exc:
        target = getattr(agent, "fn", type(agent))
        names = getattr(getattr(target, "__code__", None), "co_names", ())
        globals_ = getattr(target, "__globals__", {})
        culprits = []
        for name in names:
            try:
                cloudpickle.dumps(globals_[name])
            except KeyError:
                continue
            except Exception:
                culprits.append(name)
        what = f"it uses {', '.join(culprits)}, which" if culprits else "something it uses"
        raise AgentLoadError(
            f"the agent cannot be sent to its runners: {what} cannot be pickled "
            f"({type(exc).__name__}: {exc}). Create such objects inside the rollout (or "
            "lazily, on first use), or run the workers in this process with inline=True"
        ) from None


class WorkerPool:
    """``n`` worker processes on this machine, restarted when one dies unexpectedly (up to
    ``max_restarts`` times in all) or retires to shed abandoned threads (``recycled`` counts
    those planned restarts, which have no limit).

    Each is a plain ``python`` process (:func:`worker_main`), not a multiprocessing child, so
    it never re-imports the user's script. ``llm_keys`` (provider API keys by resource name,
    see :class:`~voltrl.resources.ApiKeys`) and ``token`` (the store's and the gateways') reach
    it through its standard input.

    A supervisor thread restarts the processes while :meth:`stop` may run in another thread:
    one lock guards the process table, and a process is started only under it and only while
    the pool is not stopping, so :meth:`stop` (which sets that under the same lock) sees every
    process there will ever be.
    """

    def __init__(
        self,
        agent: LitAgent,
        store_url: str,
        *,
        n: int,
        token: str | None = None,
        config: RunnerConfig = RunnerConfig(),
        max_restarts: int = 10,
        name: str = "worker",
        llm_keys: Mapping[str, str] | None = None,
    ) -> None:
        self._blob = pickled_agent(agent)
        self._llm_keys = dict(llm_keys or {})
        self._url, self._token, self._config = store_url, token, config
        self._n, self._name, self._max_restarts = n, name, max_restarts
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        """The live worker of each id (one that died for good is dropped); guarded by the
        pool's lock."""
        self._lock = threading.Lock()
        # (worker id, its process) as each exits; None wakes the supervisor to stop
        self._exits: queue.Queue[tuple[str, subprocess.Popen[bytes]] | None] = queue.Queue()
        self.restarts = 0
        self.recycled = 0
        self._stopping = False
        self._supervisor: threading.Thread | None = None

    def _spawn(self, worker_id: str) -> None:
        """Start the process of ``worker_id`` unless the pool is stopping; the caller holds
        the lock, so :meth:`stop` waits for a start under way and then stops that process."""
        import pickle

        if self._stopping:
            return
        settings = {
            "store_url": self._url,
            "token": self._token,
            "agent_blob": self._blob,
            "worker_id": worker_id,
            "config": self._config,
            "sys_path": list(sys.path),
            "llm_keys": self._llm_keys,
        }
        proc = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN], stdin=subprocess.PIPE)
        assert proc.stdin is not None
        with proc.stdin:
            proc.stdin.write(pickle.dumps(settings))
        self.processes[worker_id] = proc
        threading.Thread(
            target=lambda: (proc.wait(), self._exits.put((worker_id, proc))),
            name=f"voltrl-{worker_id}-exit",
            daemon=True,
        ).start()

    def start(self) -> None:
        """Start the processes and a thread that restarts any that die."""
        with self._lock:
            for i in range(self._n):
                self._spawn(f"{self._name}-{i}")
        self._supervisor = threading.Thread(
            target=self._supervise, name=f"voltrl-{self._name}-supervisor", daemon=True
        )
        self._supervisor.start()

    def _supervise(self) -> None:
        """The supervisor thread: handle each exit (:meth:`_restart`) until the pool stops or
        every worker has died for good."""
        while True:
            exit_ = self._exits.get()
            with self._lock:
                if exit_ is None or self._stopping:
                    return
                wid, proc = exit_
                if self.processes.get(wid) is not proc:
                    continue  # an exit already handled
                self._restart(wid, proc.returncode)
                if not self.processes:
                    return  # every worker died for good

    def _restart(self, wid: str, code: int | None) -> None:
        """Restart ``wid``, which exited with ``code``, or drop it for good (under the lock)."""
        if code == AGENT_LOAD_EXIT_CODE:  # said on its stderr; another try fails the same
            log.error("worker %s could not load the agent; not restarting it", wid)
            self.processes.pop(wid)
        elif code == RECYCLE_EXIT_CODE:
            self.recycled += 1
            log.warning(
                "worker %s retired: more than %d threads of timed-out or cancelled sync "
                "rollouts were still running in it (max_abandoned_threads); starting "
                "a fresh process",
                wid,
                self._config.max_abandoned_threads,
            )
            self._spawn(wid)
        elif self.restarts >= self._max_restarts:
            log.error("worker %s died (exit %s); restart limit reached", wid, code)
            self.processes.pop(wid)
        else:
            self.restarts += 1
            log.warning("worker %s died (exit %s); restarting it", wid, code)
            self._spawn(wid)

    @property
    def alive(self) -> int:
        """How many worker processes are running."""
        with self._lock:
            return sum(p.poll() is None for p in self.processes.values())

    def _stopped(self) -> list[subprocess.Popen[bytes]]:
        """Mark the pool stopping, so no process starts any more; returns its processes (a
        start under way finishes first: it holds the lock)."""
        with self._lock:
            self._stopping = True
            return list(self.processes.values())

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM every worker (they finish or release in-flight rollouts, see
        :func:`run_worker`), then kill the ones still running after ``grace_s`` (default: the
        config's ``grace_s`` plus 10 s to report); returns once they and the supervisor
        thread have ended."""
        processes = self._stopped()
        self._exits.put(None)
        if grace_s is None:
            grace_s = self._config.grace_s + 10.0
        for proc in processes:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in processes:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self._supervisor is not None:
            self._supervisor.join()

    def kill(self) -> None:
        """SIGKILL every worker now (their leases expire and the store retries their
        rollouts); none starts any more."""
        for proc in self._stopped():
            if proc.poll() is None:
                proc.kill()


def run_runner(
    agent: LitAgent,
    store_url: str,
    *,
    token: str | None = None,
    workers: int = 1,
    config: RunnerConfig = RunnerConfig(),
    name: str | None = None,
) -> int:
    """``voltrl runner``: ``workers`` worker processes on this machine running ``agent`` for
    the store server at ``store_url``, until SIGTERM or SIGINT.

    Checks first that the store answers (a clear :class:`~voltrl.errors.StoreError` if it is
    unreachable or refuses the token). On the signal, workers stop claiming and rollouts in
    flight get ``config.grace_s`` seconds before they are released. Returns the exit status:
    0 after a signal, 1 if every worker died for good.
    """
    import socket

    from voltrl.store.http import HTTPStore

    async def check() -> None:
        store = HTTPStore(store_url, token=token, retries=0)
        try:
            await store.get_resources()
        finally:
            await store.close()

    asyncio.run(check())
    if workers < 1:
        raise ValueError("workers must be >= 1")
    name = name or f"{socket.gethostname()}-{os.getpid()}"
    pool = WorkerPool(agent, store_url, n=workers, token=token, config=config, name=name)
    stop = threading.Event()
    handlers = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    pool.start()
    print(
        f"voltrl runner {name}: {workers} worker(s) x {config.max_concurrency} rollouts "
        f"against {store_url}",
        flush=True,
    )
    try:
        while not stop.wait(0.5):
            if not pool.processes:
                log.error("every worker died; giving up")
                return 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        pool.stop()
    print(f"voltrl runner {name}: stopped", flush=True)
    return 0
