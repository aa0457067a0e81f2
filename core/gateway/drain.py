"""The drain: holding new calls back while in-flight ones finish (a weight update), or refusing
them for good (a run ending).

:class:`Drain` counts the calls in flight; ``pause`` returns once there are none and new calls
wait in :meth:`Drain.admit` until ``resume`` (or get 429 after a while); after ``close`` every
new or waiting call gets 503 at once, and ``abort`` also cuts short the calls in flight (their
tasks are cancelled). It runs on the serving event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from voltrl.gateway.errors import GatewayHTTPError


class Drain:
    """Admission of calls to the gateway: paused, resumed, closed.

    Args:
        wait_s: while paused, how long a new call waits for :meth:`resume` before it is
            answered 429 (0 answers at once).
        retry_after_s: the ``Retry-After`` sent with that 429.
    """

    def __init__(self, wait_s: float, retry_after_s: float) -> None:
        self.wait_s, self.retry_after_s = wait_s, retry_after_s
        self.paused = False
        self.closed = False
        self.aborted = False
        self.inflight = 0
        self._tasks: set[asyncio.Task[object]] = set()
        self.waiting = 0
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()

    async def pause(self) -> None:
        """Admit no new calls; return once every call in flight has finished."""
        self.paused = True
        self._resumed.clear()
        while self.inflight:
            await self._idle.wait()

    def resume(self) -> None:
        """Admit calls again; the ones waiting go ahead."""
        self.paused = False
        self._resumed.set()

    async def close(self) -> None:
        """Refuse every new and waiting call; return once every call in flight has finished."""
        self.closed = True
        self._resumed.set()  # wake the waiting calls: they are refused
        while self.inflight:
            await self._idle.wait()

    def abort(self) -> None:
        """Refuse every new and waiting call, and cancel the tasks of the calls in flight
        (they see :attr:`aborted` and answer 503 if they can); :meth:`close` then returns
        once they have left."""
        self.closed = self.aborted = True
        self._resumed.set()
        for task in list(self._tasks):
            task.cancel()

    async def admit(self) -> None:
        """Wait while paused (up to ``wait_s``), then count the call as in flight (the caller
        calls :meth:`leave` when it is done); a closed drain answers 503 at once."""
        if self.closed:
            raise _closed()
        if self.paused:
            deadline = time.monotonic() + self.wait_s
            self.waiting += 1
            try:
                while self.paused:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        retry_after = str(max(1, round(self.retry_after_s))).encode()
                        raise GatewayHTTPError(
                            429,
                            "the gateway is paused (model weights are being updated); retry later",
                            type="rate_limit_error",
                            headers=[(b"retry-after", retry_after)],
                        )
                    with contextlib.suppress(TimeoutError):
                        # not asyncio.wait_for: it can lose a cancellation (see Notifier.wait)
                        async with asyncio.timeout(left):
                            await self._resumed.wait()
                    if self.closed:
                        raise _closed()
            finally:
                self.waiting -= 1
        self.inflight += 1
        self._idle.clear()
        if (task := asyncio.current_task()) is not None:
            self._tasks.add(task)

    def leave(self) -> None:
        """An admitted call has finished (and been recorded)."""
        if (task := asyncio.current_task()) is not None:
            self._tasks.discard(task)
        self.inflight -= 1
        if not self.inflight:
            self._idle.set()


def aborted() -> GatewayHTTPError:
    """What a call in flight gets when the gateway stops without it (:meth:`Drain.abort`)."""
    return GatewayHTTPError(
        503, "the run is ending: this gateway stopped before the call finished", type="api_error"
    )


def _closed() -> GatewayHTTPError:
    """What a call gets from a closed gateway (:meth:`Drain.close`)."""
    return GatewayHTTPError(
        503, "the run is ending: this gateway takes no more calls", type="api_error"
    )
