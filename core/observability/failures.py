"""Rollout failures made visible on the trainer's console.

:class:`FailureReport` looks at each rollout as it finishes (``TrainContext.wait`` hands them
over) and reads the failed attempts from the store. The first occurrence of each distinct
error is printed at once: the rollout and task, the error, and the frames of the agent's own
code (frames of VoltRL, the standard library and installed packages are hidden; the raising
frame is always kept). Errors are the same when they have the same type and raising line, or,
without a traceback (timeouts, expired leases), the same message up to numbers and ids.

It also counts the rollouts that succeeded without any reward (the agent returned None and
emitted none, neither for the whole rollout nor for any of its agents): they train nothing and
no reward mean counts them, so :meth:`FailureReport.warn_unrewarded` says so once, with their
count.

The report also decides when a run has failed too often: :meth:`FailureReport.check` raises
:class:`~voltrl.errors.TooManyFailuresError` once the failed share of the rollouts finished so
far reaches ``stop_at_rate``. At the end of the run, :meth:`FailureReport.print_summary` counts
each distinct error, with one example rollout.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.text import Text

from voltrl._console import printable
from voltrl._console import text as console_text
from voltrl.errors import TooManyFailuresError
from voltrl.store.base import Store
from voltrl.types import Attempt, Rollout

FAILED_ATTEMPT = frozenset({"failed", "timeout", "expired"})
TIMEOUT_ADVICE = (
    "the rollout ran past its time limit and was cancelled (a timeout is retried, up to"
    " max_attempts); give rollouts more time with `voltrl dev --timeout SECONDS` or"
    " Trainer(rollout_timeout_s=...)"
)
_FRAME = re.compile(r'^  File "(?P<path>[^"]+)", line (?P<line>\d+)')
_WITH_DIGITS = re.compile(r"[\w.-]*\d[\w.-]*")


def _hidden_roots() -> tuple[Path, ...]:
    """Directories whose frames are not the agent's own: VoltRL's packages, the standard
    library and installed packages."""
    roots = [Path(__file__).resolve().parents[1]]  # the voltrl package: core/
    spec = importlib.util.find_spec("voltrl.adapters")
    roots += [Path(p).resolve() for p in (spec.submodule_search_locations or [])] if spec else []
    for name in ("stdlib", "platstdlib", "purelib", "platlib"):
        if path := sysconfig.get_path(name):
            roots.append(Path(path).resolve())
    return tuple(roots)


HIDDEN_ROOTS = _hidden_roots()


def _hidden(path: str) -> bool:
    """Whether a frame's file is not the agent's own (by its path, on a remote runner too)."""
    if path.startswith("<frozen ") or "/site-packages/" in path or "/dist-packages/" in path:
        return True
    resolved = Path(path).resolve()
    return any(resolved.is_relative_to(root) for root in HIDDEN_ROOTS)


@dataclass(frozen=True)
class Frame:
    """One traceback frame as ``traceback`` formats it: the ``File ...`` line and its code."""

    path: str
    line: int
    text: str


def traceback_frames(traceback: str) -> list[Frame]:
    """The frames of the last exception in a formatted traceback (the one that was raised,
    after any it was chained to), outermost first."""
    lines = traceback.rstrip("\n").split("\n")
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (")]
    frames: list[Frame] = []
    for line in lines[starts[-1] + 1 :] if starts else []:
        if match := _FRAME.match(line):
            frames.append(Frame(match["path"], int(match["line"]), line))
        elif line.startswith("    ") and frames:
            frames[-1] = Frame(frames[-1].path, frames[-1].line, f"{frames[-1].text}\n{line}")
        elif not line.startswith(" "):
            break
    return frames


def agent_frames(frames: Sequence[Frame], package: str | None = None) -> list[Frame]:
    """The frames of the agent's own code, and always the last (raising) one. ``package`` is
    the agent's top-level package, whose frames are shown even where it is installed."""
    own = (f"/{package}/", f"/{package}.py") if package else ()

    def shown(i: int, frame: Frame) -> bool:
        return i == len(frames) - 1 or any(p in frame.path for p in own) or not _hidden(frame.path)

    return [f for i, f in enumerate(frames) if shown(i, f)]


def error_key(attempt: Attempt) -> str:
    """What makes two failures the same error: type and raising line, or the message with
    every word holding a digit (ids, numbers) blanked when there is no traceback."""
    error = attempt.error or attempt.status
    frames = traceback_frames(attempt.traceback or "")
    if frames:
        return f"{error.split(':', 1)[0]} at {frames[-1].path}:{frames[-1].line}"
    return _WITH_DIGITS.sub("#", error)


@dataclass
class _Error:
    """One distinct error: its first occurrence and how many attempts it failed."""

    first: Attempt
    count: int = 0


class FailureReport:
    """The failures of one run: printed as they first occur, summarised at the end, and
    checked against the run's limit.

    Args:
        stop_at_rate: the share of finished rollouts (succeeded or failed) that, once failed,
            stops the run: 1.0 when every rollout so far failed, 0.5 when half did; None
            never stops.
        console: where to print (default: a console on stdout).
        agent_package: the agent's top-level package: its frames are the agent's own even
            where it is installed among the site packages.
    """

    def __init__(
        self,
        stop_at_rate: float | None = 1.0,
        console: Console | None = None,
        agent_package: str | None = None,
    ) -> None:
        self.stop_at_rate = stop_at_rate
        self.agent_package = agent_package
        self.console = console or Console()
        self.finished = 0
        self.failed = 0
        self.unrewarded: list[str] = []
        """The rollouts that succeeded without a reward, by id."""
        self._warned_unrewarded = False
        self._seen: set[str] = set()
        self._counted: set[str] = set()
        self._tried: dict[str, int] = {}
        self._errors: dict[str, _Error] = {}

    async def observe(
        self, store: Store, rollouts: Sequence[Rollout], console: Console | None = None
    ) -> None:
        """Count the rollouts not seen before and print the first occurrence of each error
        their attempts failed with (on ``console``, e.g. a progress bar's)."""
        for rollout in rollouts:
            if rollout.rollout_id in self._seen or not rollout.finished:
                continue
            self._seen.add(rollout.rollout_id)
            if rollout.status != "cancelled":
                self.finished += 1
                self.failed += rollout.status == "failed"
            unrewarded = rollout.status == "succeeded" and rollout.reward is None
            if unrewarded and not await _any_reward(store, rollout):
                self.unrewarded.append(rollout.rollout_id)
            if rollout.status == "failed" or rollout.attempt_count > 1:
                for attempt in await store.get_attempts(rollout.rollout_id):
                    if attempt.status in FAILED_ATTEMPT:
                        self._count(rollout, attempt, console or self.console)

    async def observe_retries(
        self, store: Store, run_id: str, console: Console | None = None
    ) -> None:
        """Print the first occurrence of errors of the run's rollouts that are being tried
        again (their earlier attempts failed), without waiting for their last attempt."""
        unfinished = await store.query_rollouts(run_id=run_id, status=["queued", "running"])
        for rollout in unfinished:
            tried = rollout.attempt_count - (rollout.status == "running")
            if tried >= 1 and self._tried.get(rollout.rollout_id) != tried:
                self._tried[rollout.rollout_id] = tried  # read its attempts once per new end
                for attempt in await store.get_attempts(rollout.rollout_id):
                    if attempt.status in FAILED_ATTEMPT:
                        self._count(rollout, attempt, console or self.console)

    def _count(self, rollout: Rollout, attempt: Attempt, console: Console) -> None:
        if attempt.attempt_id in self._counted:
            return
        self._counted.add(attempt.attempt_id)
        error = self._errors.setdefault(error_key(attempt), _Error(attempt))
        error.count += 1
        if error.count == 1:
            text = _first_occurrence(rollout, attempt, self.agent_package)
            console.print(text, soft_wrap=True, highlight=False)

    def warn_unrewarded(self, console: Console | None = None) -> None:
        """Say once, with their count so far, that rollouts succeeded without a reward."""
        if not self.unrewarded or self._warned_unrewarded:
            return
        self._warned_unrewarded = True
        text = Text(
            f"warning: {len(self.unrewarded)} of {self.finished} rollouts finished without any "
            f"reward (e.g. rollout {self.unrewarded[0]}): the agent returned None and emitted "
            "none. Return the reward, or call vl.emit_reward(value) in the rollout; a rollout "
            "without one trains nothing and no reward mean counts it (this warning is shown "
            "once; the run's summary counts them)",
            style="yellow",
        )
        (console or self.console).print(text, soft_wrap=True, highlight=False)

    def check(self) -> None:
        """Raise :class:`~voltrl.errors.TooManyFailuresError` when the failed share of the
        finished rollouts has reached ``stop_at_rate``."""
        if self.stop_at_rate is None or not self.failed:
            return
        if self.failed / self.finished < self.stop_at_rate:
            return
        share = (
            f"all {self.finished} rollouts failed"
            if self.failed == self.finished
            else f"{self.failed} of {self.finished} rollouts failed"
        )
        first = next(iter(self._errors.values()), None)
        cause = f"; the first error: {first.first.error}" if first else ""
        raise TooManyFailuresError(
            f"the run stopped: {share}, reaching stop_at_failure_rate={self.stop_at_rate}"
            f"{cause} (each distinct error is printed above with its traceback)"
        )

    def print_summary(self) -> None:
        """Print how many rollouts had no reward, and each distinct error with its count and
        an example rollout (nothing when every rollout was rewarded and no attempt failed)."""
        if self.unrewarded:
            text = Text(
                f"no reward: {len(self.unrewarded)} of {self.finished} rollouts finished "
                f"without any (e.g. rollout {self.unrewarded[0]})",
                style="bold",
            )
            self.console.print(text, soft_wrap=True, highlight=False)
        if not self._errors:
            return
        attempts = sum(e.count for e in self._errors.values())
        text = Text(
            f"failures: {self.failed} of {self.finished} rollouts failed"
            f" ({attempts} failed attempts, by error:)",
            style="bold",
        )
        for error in sorted(self._errors.values(), key=lambda e: -e.count):
            text.append(printable(f"\n  {error.count}x {_first_line(error.first.error)}"))
            text.append(f"  (e.g. rollout {error.first.rollout_id})", style="dim")
        self.console.print(text, soft_wrap=True, highlight=False)


async def _any_reward(store: Store, rollout: Rollout) -> bool:
    """Whether a succeeded rollout without a final reward still has one somewhere: emitted
    for some of its agents, or on a transition it returned."""
    if await store.get_rewards(rollout.rollout_id):
        return True
    attempts = await store.get_attempts(rollout.rollout_id)
    return any(t.reward is not None for a in attempts for t in a.transitions or [])


def _first_line(error: str | None) -> str:
    return (error or "failed").split("\n", 1)[0]


def _first_occurrence(rollout: Rollout, attempt: Attempt, package: str | None) -> Text:
    """The error of ``attempt`` with the agent's frames, as printed the first time."""
    task = json.dumps(rollout.task.input, default=str)
    task = task if len(task) <= 80 else task[:77] + "..."
    text = Text("rollout error: ", style="bold red")
    text.append(console_text(attempt.error or attempt.status, style="red"))
    text.append(
        printable(
            f"\n  rollout {rollout.rollout_id} (attempt {attempt.index}), task"
            f" {rollout.task.task_id} {task}"
        ),
        style="dim",
    )
    if attempt.status == "timeout":
        text.append(f"\n  {TIMEOUT_ADVICE}", style="yellow")
    frames = traceback_frames(attempt.traceback or "")
    shown = agent_frames(frames, package)
    for frame in shown:
        text.append(printable(f"\n{frame.text}"))
    if len(shown) < len(frames):
        text.append(
            f"\n  ({len(frames) - len(shown)} frames of voltrl, the standard library and "
            f"installed packages hidden; the store keeps the full traceback, attempt "
            f"{attempt.attempt_id})",
            style="dim",
        )
    return text
