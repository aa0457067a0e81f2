"""Ctrl-C and SIGTERM during a run: the first stops the run cleanly, a second exits at once.

A terminal's Ctrl-C (SIGINT) and a scheduler's SIGTERM (a preempted job, ``docker stop``,
``kill``) are handled alike: the first cancels the run's main task, so the rollouts in flight
are cancelled, the algorithm checkpoints (LocalRL does when its training is cancelled) and
the run is marked ``interrupted``, which ``resume`` continues. The run then ends in
:class:`Interrupted` (a ``KeyboardInterrupt``) after Ctrl-C, or in :class:`Terminated` (exit
status 143) after SIGTERM. A second signal of either kind kills the workers and exits at once,
with ``128 + signal``.

Neither prints a traceback when a script leaves it uncaught: the run has already said why it
stopped and where its state is, and the stack of ``asyncio.run`` would say nothing more.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType
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


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run (its state saved, the run marked ``interrupted``): a
    ``KeyboardInterrupt``. Left uncaught by a script, it prints one line, not the stack of
    ``asyncio.run``, and the process still ends as Python ends one stopped by Ctrl-C: killed
    by SIGINT, so that a shell loop running the script stops too (:func:`quiet_when_uncaught`)."""

    def __init__(self) -> None:
        super().__init__("the run was stopped by Ctrl-C")

    def __reduce__(self) -> tuple[type[Interrupted], tuple[()]]:
        return (Interrupted, ())


_uncaught = threading.Event()
"""Set when an :class:`Interrupted` ended the program (not in an interactive session)."""


def _die_of_sigint() -> None:
    """At exit, after an uncaught :class:`Interrupted`: be killed by SIGINT, as CPython does
    after an uncaught ``KeyboardInterrupt`` (registered when this module is imported, so it
    runs after the exit handlers registered later: the run's and its libraries')."""
    if _uncaught.is_set():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


atexit.register(_die_of_sigint)


def quiet_when_uncaught() -> None:
    """Install, once per process, an exception hook that prints an uncaught
    :class:`Interrupted` as one line (every other exception goes to the hook in place
    before)."""
    previous = sys.excepthook
    if getattr(previous, "voltrl_quiet", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if not isinstance(value, Interrupted):
            previous(kind, value, tb)
            return
        print(f"KeyboardInterrupt: {value}", file=sys.stderr, flush=True)
        if not sys.flags.interactive and not hasattr(sys, "ps1"):
            _uncaught.set()

    hook.voltrl_quiet = True  # type: ignore[attr-defined]
    sys.excepthook = hook


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
        quiet_when_uncaught()
        raise Interrupted from None
    finally:
        for sig, handler in previous.items():
            # asyncio resets the signal to its default; put back what was there
            loop.remove_signal_handler(sig)
            if handler is not None:  # None: a handler not set from Python, left as asyncio left it
                signal.signal(sig, handler)
