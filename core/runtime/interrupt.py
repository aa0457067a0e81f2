"""Ctrl-C and SIGTERM during a run: the first stops the run cleanly, a second exits at once.

A terminal's Ctrl-C (SIGINT) and a scheduler's SIGTERM (a preempted job, ``docker stop``,
``kill``) are handled alike: the first cancels the run's main task, so the rollouts in flight
are cancelled, the algorithm checkpoints (LocalRL does when its training is cancelled) and
the run is marked ``interrupted``, which ``resume`` continues. The run then ends in
:class:`Interrupted` (a ``KeyboardInterrupt``) after Ctrl-C, or in :class:`Terminated` (exit
status 143) after SIGTERM. A second signal of either kind kills the workers and exits at once,
with ``128 + signal``.

Neither prints a traceback when a script leaves it uncaught (both are also ``SystemExit``s):
the run has already said why it stopped and where its state is, and the stack of
``asyncio.run`` would say nothing more.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

_T = TypeVar("_T")

SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
"""The signals that stop a run, with the name the console gives each."""


class Terminated(SystemExit):
    """SIGTERM stopped the run (its state is saved as after Ctrl-C). A :class:`SystemExit`
    with status 143 (128 + SIGTERM), so that a script or ``voltrl`` command that does not
    catch it exits as a process killed by SIGTERM would, which schedulers read as
    preempted, yet without a traceback."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


class Interrupted(KeyboardInterrupt, SystemExit):
    """Ctrl-C stopped the run (its state saved, the run marked ``interrupted``). A
    ``KeyboardInterrupt``, caught as one; and a :class:`SystemExit` with status 130 (128 +
    SIGINT), so that a script that leaves it uncaught ends as a program stopped by Ctrl-C,
    without a traceback (the run has printed why it stopped and where it is)."""

    def __init__(self) -> None:
        SystemExit.__init__(self, 128 + signal.SIGINT)


async def interruptible(main: Awaitable[_T], kill: Callable[[], None]) -> _T:
    """Await ``main`` with Ctrl-C and SIGTERM handled. The first of either cancels ``main``
    (which winds down cleanly and marks its run interrupted) and then raises
    :class:`Interrupted` (Ctrl-C) or :class:`Terminated` (SIGTERM); a second one calls
    ``kill`` (which should be quick) and exits the process at once with ``128 + signal``.

    Signals are handled only in the main thread (Python delivers them there); elsewhere
    ``main`` is awaited as it is. The handlers in place before are restored afterwards."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    received: list[signal.Signals] = []

    def on_signal(signum: signal.Signals) -> None:
        received.append(signum)
        if len(received) == 1:
            print(
                f"\n{SIGNALS[signum]}: stopping the run (Ctrl-C or SIGTERM again to exit at once)",
                file=sys.stderr,
                flush=True,
            )
            task.cancel()
            return
        print("exiting now", file=sys.stderr, flush=True)
        kill()
        os._exit(128 + signum)

    handled = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS} if handled else {}
    for sig in previous:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await main
    except asyncio.CancelledError:
        if not received:
            raise
        if received[0] == signal.SIGTERM:
            print("terminated by SIGTERM", file=sys.stderr, flush=True)
            raise Terminated from None
        raise Interrupted from None
    finally:
        for sig, handler in previous.items():
            # asyncio resets the signal to its default; put back what was there
            loop.remove_signal_handler(sig)
            if handler is not None:  # None: a handler not set from Python, left as asyncio left it
                signal.signal(sig, handler)
