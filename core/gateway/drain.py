"""The drain: holding new calls back while in-flight ones finish (a weight update), or refusing
them for good (a run ending), and cutting off the calls that must not be waited for.

:class:`Drain` keeps a :class:`Flight` per call in flight. ``pause`` returns once there are none
(cutting off what is left after its deadline) and new calls wait in :meth:`Drain.admit` until
``resume`` (or get 429 after a while); after ``close`` every new or waiting call gets 503 at once,
and ``abort`` also cuts off the calls in flight. A call is cut off by cancelling its task, once,
with the reason kept on its flight (:data:`CUT_REASONS`); the gateway then answers it (or not:
its client is gone) and records it as abandoned. It runs on the serving event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from voltrl.gateway.errors import GatewayHTTPError

CLIENT_GONE = "client_disconnected"
PAUSE_DEADLINE = "pause_deadline"
RUN_ENDING = "run_ending"
CUT_REASONS = (CLIENT_GONE, PAUSE_DEADLINE, RUN_ENDING)
"""Why a call was cut off: its client disconnected, a pause outlasted its deadline (a weight
update does not wait for it), or the gateway stopped while it ran."""


class Flight:
    """One admitted call: its task, whether its response has ended, and why it was cut off
    (None: it was not)."""

    def __init__(self, task: asyncio.Task[object] | None) -> None:
        self.task = task
        self.responded = False  # the answer is being recorded and sent: nothing left to cut
        self.cut_reason: str | None = None

    def commit(self) -> None:
        """The call's answer is complete and about to be recorded: from now on it is not cut
        off (a cut would record it as abandoned after all, and its client would ask again)."""
        self.responded = True

    def cut(self, reason: str) -> bool:
        """Cancel the call's task with ``reason``, unless it was cut already or has
        responded; returns whether it was cut now."""
        if self.cut_reason is not None or self.responded or self.task is None:
            return False
        self.cut_reason = reason
        self.task.cancel()
        return True


class Drain:
    """Admission of calls to the gateway: paused, resumed, closed.

    Args:
        wait_s: while paused, how long a new call waits for :meth:`resume` before it is
            answered 429 (0 answers at once).
        retry_after_s: the ``Retry-After`` sent with that 429.
        pause_deadline_s: how long :meth:`pause` waits for the calls in flight before it cuts
            off the rest (None: no deadline).
    """

    def __init__(
        self, wait_s: float, retry_after_s: float, pause_deadline_s: float | None = None
    ) -> None:
        self.wait_s, self.retry_after_s = wait_s, retry_after_s
        self.pause_deadline_s = pause_deadline_s
        self.paused = False
        self.closed = False
        self.flights: set[Flight] = set()
        self.waiting = 0
        self.cut_off: dict[str, int] = {}  # calls cut off so far, by reason
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def inflight(self) -> int:
        """Calls admitted and not yet left."""
        return len(self.flights)

    async def pause(self, deadline_s: float | None = None) -> None:
        """Admit no new calls; return once every call in flight has left. After ``deadline_s``
        (default: ``pause_deadline_s``; None waits for ever) the calls still in flight are cut
        off (:data:`PAUSE_DEADLINE`) and the pause returns once they have left."""
        self.paused = True
        self._resumed.clear()
        deadline = self.pause_deadline_s if deadline_s is None else deadline_s
        try:
            # not asyncio.wait_for: it can lose a cancellation (see Notifier.wait)
            async with asyncio.timeout(deadline):
                await self._idle_wait()
        except TimeoutError:
            self.cut(PAUSE_DEADLINE)
            # what is left has its answer and is only sending it: bounded, not waited for
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(deadline):
                    await self._idle_wait()

    def resume(self) -> None:
        """Admit calls again; the ones waiting go ahead."""
        self.paused = False
        self._resumed.set()

    async def close(self) -> None:
        """Refuse every new and waiting call; return once every call in flight has finished."""
        self.closed = True
        self._resumed.set()  # wake the waiting calls: they are refused
        await self._idle_wait()

    def abort(self) -> None:
        """Refuse every new and waiting call, and cut off the calls in flight
        (:data:`RUN_ENDING`); :meth:`close` then returns once they have left."""
        self.closed = True
        self._resumed.set()
        self.cut(RUN_ENDING)

    def cut(self, reason: str, flight: Flight | None = None) -> int:
        """Cut off ``flight``, or every call in flight, unless it has responded; returns how
        many were cut (counted in :attr:`cut_off`)."""
        n = sum(f.cut(reason) for f in ([flight] if flight else list(self.flights)))
        if n:
            self.cut_off[reason] = self.cut_off.get(reason, 0) + n
        return n

    async def admit(self) -> Flight:
        """Wait while paused (up to ``wait_s``), then count the call as in flight and return
        its :class:`Flight` (the caller passes it to :meth:`leave` when it is done); a closed
        drain answers 503 at once."""
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
        flight = Flight(asyncio.current_task())
        self.flights.add(flight)
        self._idle.clear()
        return flight

    def leave(self, flight: Flight) -> None:
        """An admitted call has finished (and been recorded)."""
        self.flights.discard(flight)
        if not self.flights:
            self._idle.set()

    async def _idle_wait(self) -> None:
        while self.flights:
            await self._idle.wait()


def cut_off_error(reason: str) -> GatewayHTTPError:
    """What a call cut off in flight gets, if its client is still there to read it: a 503
    the OpenAI clients retry (after a weight update, the retry runs on the new weights)."""
    if reason == RUN_ENDING:
        message = "the run is ending: this gateway stopped before the call finished"
    else:
        message = "the call was cut off: the model weights are being updated; retry it"
    return GatewayHTTPError(503, message, type="api_error")


def _closed() -> GatewayHTTPError:
    """What a call gets from a closed gateway (:meth:`Drain.close`)."""
    return GatewayHTTPError(
        503, "the run is ending: this gateway takes no more calls", type="api_error"
    )
