"""The fan-out: the run's trackers, called on one background thread so the event loop never waits.

The event loop that calls :class:`Trackers` also serves the gateways and the store, and a
tracker's call can take seconds or hang (a slow or unreachable MLflow or W&B server): were it
made on the loop, every rollout would stall with it. So the loop only queues calls, and one
thread makes them, in order, tracker after tracker:

- Lines (each metrics line, each validation's sample rollouts) are dropped and counted
  (:attr:`Trackers.dropped`) while ``max_queued`` of them wait: the loop never waits for room.
  ``start``, ``finish`` and ``close`` are always queued.
- A tracker that raises is reported once on stderr and gets nothing more but its ``close``
  (one whose ``start`` raised is closed at once); the others go on.
- :meth:`Trackers.end` queues the summary, then :meth:`Trackers.close` waits up to
  ``close_timeout_s`` for the queue to drain and says how many lines were dropped or not
  delivered. What is still queued then goes on on the thread (a daemon) until the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any

from voltrl._console import printable
from voltrl.observability.metrics import summarize
from voltrl.observability.trackers.base import Logger, RolloutRow, numeric
from voltrl.types import Rollout, Run

if TYPE_CHECKING:
    from voltrl.store.base import Store


@dataclass(frozen=True)
class _Call:
    """One hook, to call on each tracker still on; a ``line`` is dropped when the queue is full."""

    hook: str
    call: Callable[[Logger], None]
    line: bool = False


class Trackers:
    """The run's loggers besides ``jsonl``, called together on one background thread: no
    method waits for a tracker, but :meth:`close` (and so :meth:`end`), at most
    ``close_timeout_s``. See the module's docstring for what is dropped and reported."""

    max_queued: int = 10_000
    """Lines that may wait for the trackers' thread; more are dropped (and counted)."""
    close_timeout_s: float = 30.0
    """How long :meth:`close` waits for the queued calls to be made."""

    def __init__(
        self,
        loggers: Sequence[Logger] = (),
        *,
        max_queued: int | None = None,
        close_timeout_s: float | None = None,
    ) -> None:
        self.loggers = [logger.model_copy(deep=True) for logger in loggers]  # fresh state
        if max_queued is not None:
            self.max_queued = max_queued
        if close_timeout_s is not None:
            self.close_timeout_s = close_timeout_s
        self.dropped = 0
        """Lines dropped because ``max_queued`` lines were waiting."""
        self._queue: SimpleQueue[_Call | None] = SimpleQueue()
        self._lock = threading.Lock()
        self._waiting = 0  # lines queued or being handed on (under _lock)
        self._thread: threading.Thread | None = None
        self._closing = False
        self._warned: set[str] = set()
        # the thread's: the loop only reads _on (a tuple, replaced whole) and _busy
        self._on: tuple[Logger, ...] = ()
        self._started: list[Logger] = []
        self._busy = ""

    def start(self, run: Run, run_dir: Path, config: Mapping[str, Any]) -> None:
        """Start the trackers' thread and queue each logger's ``start``, in order."""
        if not self.loggers or self._thread is not None:
            return
        self._on = tuple(self.loggers)
        self._thread = threading.Thread(target=self._work, name="voltrl-trackers", daemon=True)
        self._thread.start()
        self._put(_Call("start", lambda logger: logger.start(run, run_dir, config)))

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Queue the numbers of one metrics line for each logger."""
        if self._on:
            values = numeric(metrics)
            self._put(_Call("log_metrics", lambda lg: lg.log_metrics(step, values), line=True))

    async def log_rollouts(self, step: int, rollouts: Sequence[Rollout], store: Store) -> None:
        """Queue the first few ``rollouts`` for the loggers that want sample rollouts."""
        wanted = max((logger.rollouts_wanted() for logger in self._on), default=0)
        if not wanted:
            return
        try:
            rows = [await _row(store, r) for r in rollouts[:wanted]]
        except Exception as exc:  # the loggers' trouble never stops the run
            self._warn("log_rollouts", f"trackers: no sample rollouts: {type(exc).__name__}: {exc}")
            return
        self._put(
            _Call(
                "log_rollouts",
                lambda logger: logger.log_rollouts(step, rows[: logger.rollouts_wanted()]),
                line=True,
            )
        )

    async def end(self, store: Store, run: Run) -> None:
        """Queue the run's summary for each logger (run.status is final), then :meth:`close`."""
        if self._thread is None or self._closing:
            return
        if self._on:
            summary = await self._summary(store, run)
            self._put(_Call("finish", lambda logger: logger.finish(summary)))
        await self.close()

    async def close(self) -> None:
        """Queue each started logger's ``close``, then wait up to ``close_timeout_s`` for the
        thread to make every queued call; say on stderr how many lines were dropped or not
        delivered, if any."""
        thread = self._thread
        if thread is None or self._closing:
            return
        self._put(_Call("close", lambda logger: logger.close()))
        self._queue.put(None)  # the thread's end
        self._closing = True
        await asyncio.to_thread(thread.join, self.close_timeout_s)
        notes = [f"{_lines(self.dropped)} dropped (the queue was full)"] if self.dropped else []
        if thread.is_alive():
            busy = f"{self._busy} still running, " if self._busy else ""
            notes.append(
                f"{_lines(self._waiting)} not delivered after {self.close_timeout_s:g} s "
                f"({busy}the rest goes on in the background until the process exits)"
            )
        if notes:
            print(f"warning: trackers: {'; '.join(notes)}", file=sys.stderr, flush=True)

    def _put(self, call: _Call) -> None:
        if self._closing:
            return
        if call.line:
            with self._lock:
                full = self._waiting >= self.max_queued
                if full:
                    self.dropped += 1
                else:
                    self._waiting += 1
            if full:  # said once; close() gives the count
                busy = f" ({self._busy} is slow)" if self._busy else ""
                self._warn("full", f"trackers: {self.max_queued} lines wait{busy}: dropping lines")
                return
        self._queue.put(call)

    def _work(self) -> None:
        """The trackers' thread: each queued call, on each tracker still on, in order."""
        while (item := self._queue.get()) is not None:
            for logger in self._started if item.hook == "close" else self._on:
                self._busy = f"{logger.name!r} {item.hook}"
                try:
                    item.call(logger)
                except Exception as exc:
                    self._fail(logger, item.hook, exc)
                else:
                    if item.hook == "start":
                        self._started.append(logger)
            self._busy = ""
            if item.line:
                with self._lock:
                    self._waiting -= 1

    def _fail(self, logger: Logger, hook: str, exc: Exception) -> None:
        """Turn ``logger`` off for the rest of the run, saying so once."""
        if any(on is logger for on in self._on):
            self._on = tuple(on for on in self._on if on is not logger)
            self._warn(
                str(id(logger)),
                f"tracker {logger.name!r} is off for the rest of the run: its {hook} raised "
                f"{type(exc).__name__}: {exc}",
            )
        if hook == "start":  # it gets no close at the end
            with contextlib.suppress(Exception):
                logger.close()

    def _warn(self, key: str, message: str) -> None:
        """Print ``message`` on stderr, the first time for ``key``."""
        if key not in self._warned:
            self._warned.add(key)
            print(f"warning: {printable(message)}", file=sys.stderr, flush=True)

    async def _summary(self, store: Store, run: Run) -> dict[str, Any]:
        """The run's summary: its status, error, duration and reward statistics by mode."""
        summary: dict[str, Any] = {"summary/status": run.status}
        if run.error:
            summary["summary/error"] = run.error
        summary["summary/duration_s"] = time.time() - run.created_at
        try:
            rollouts = await store.query_rollouts(run_id=run.run_id)
            for mode in sorted({r.mode for r in rollouts}):
                stats = summarize(r for r in rollouts if r.mode == mode)
                summary.update(numeric(stats.flat(f"summary/{mode}/")))
        except Exception as exc:  # the store may be why the run failed
            self._warn("finish", f"trackers: no reward statistics: {type(exc).__name__}: {exc}")
        return summary


def _lines(n: int) -> str:
    return f"{n} line" if n == 1 else f"{n} lines"


async def _row(store: Store, rollout: Rollout) -> RolloutRow:
    from voltrl.trajectory import assistant_message

    response = None
    if rollout.final_attempt_id is not None:
        calls = await store.get_llm_calls(rollout.rollout_id, rollout.final_attempt_id)
        if calls:
            content = assistant_message(calls[-1]).get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            response = None if content is None else str(content)
    return RolloutRow(
        rollout_id=rollout.rollout_id,
        mode=rollout.mode,
        status=rollout.status,
        reward=rollout.reward,
        input=json.dumps(rollout.task.input, default=str),
        response=response,
        error=rollout.error,
    )
