"""Rewards, events and spans from anywhere inside a rollout.

The runner activates a :class:`RolloutContext` around each rollout. ``emit_reward`` finds it
through a context variable, so it works in the agent's code, in asyncio tasks it creates, and
in threads started by ``asyncio.to_thread`` / ``loop.run_in_executor`` with a copied context.
A bare ``threading.Thread`` does not inherit context variables in Python 3.11; there the
process's only active rollout is used, and if several are active the call raises
:class:`~voltrl.errors.NoActiveRolloutError` telling you to start the thread with
``contextvars.copy_context().run``.

What is emitted is buffered on the context and reported with the attempt's result in one
store write, so a reward from an attempt that lost its lease is never applied.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from voltrl.errors import InvalidRewardError, NoActiveRolloutError
from voltrl.resources import Resources
from voltrl.types import Reward, RolloutMode, Span, Task, new_id, now

_current: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar(
    "voltrl_rollout", default=None
)
_active: dict[str, RolloutContext] = {}
_active_lock = threading.Lock()


@dataclass
class RolloutContext:
    """Everything about the rollout attempt being run; passed to agents as ``ctx``."""

    rollout_id: str
    attempt_id: str
    task: Task
    mode: RolloutMode
    resources: Resources
    worker_id: str = ""
    trace_id: str = field(default_factory=lambda: new_id("trace")[6:])
    rewards: list[Reward] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def emit_reward(
        self, value: Any, *, name: str = "reward", metadata: dict[str, Any] | None = None
    ) -> Reward:
        """Record a reward now. The last one emitted is the rollout's reward unless the
        agent returns one; earlier ones are per-step rewards for credit assignment."""
        reward = Reward(
            rollout_id=self.rollout_id,
            attempt_id=self.attempt_id,
            value=check_reward(value, self.rollout_id),
            name=name,
            source="emit",
            metadata=metadata or {},
        )
        with self._lock:
            self.rewards.append(reward)
        return reward

    def add_span(self, span: Span) -> Span:
        """Record a finished span of this rollout."""
        with self._lock:
            self.spans.append(span)
        return span

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Span]:
        """Time a block as a span. It ends ``ok`` unless the block set ``span.status`` itself
        or raised, which marks it ``error`` (the exception is re-raised)."""
        span = Span(
            rollout_id=self.rollout_id,
            attempt_id=self.attempt_id,
            trace_id=self.trace_id,
            name=name,
            attributes=attributes,
        )
        try:
            yield span
            if span.status == "unset":
                span.status = "ok"
        except BaseException as exc:
            span.status = "error"
            span.events.append(
                {
                    "name": "exception",
                    "time": now(),
                    "message": repr(exc),
                    "stacktrace": traceback.format_exc(),
                }
            )
            raise
        finally:
            span.end_time = now()
            self.add_span(span)


def check_reward(value: Any, rollout_id: str | None = None) -> float:
    """``value`` as a finite float, or :class:`InvalidRewardError` naming the rollout."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRewardError(
            f"a reward must be a real number, got {type(value).__name__} {value!r}", rollout_id
        )
    value = float(value)
    if not math.isfinite(value):
        raise InvalidRewardError(f"a reward must be finite, got {value}", rollout_id)
    return value


@contextlib.contextmanager
def activate(ctx: RolloutContext) -> Iterator[RolloutContext]:
    """Make ``ctx`` the current rollout for this block (the runner does this)."""
    token = _current.set(ctx)
    with _active_lock:
        _active[ctx.attempt_id] = ctx
    try:
        yield ctx
    finally:
        _current.reset(token)
        with _active_lock:
            _active.pop(ctx.attempt_id, None)


def find_rollout() -> RolloutContext | None:
    """The rollout being run here, or None: the context's own rollout, else the only rollout
    running in this process (a bare thread), else None when there are none or several."""
    ctx = _current.get()
    if ctx is not None:
        return ctx
    with _active_lock:
        active = list(_active.values())
    return active[0] if len(active) == 1 else None


def current_rollout() -> RolloutContext:
    """The rollout being run here; raises :class:`NoActiveRolloutError` outside one."""
    ctx = find_rollout()
    if ctx is not None:
        return ctx
    with _active_lock:
        active = list(_active.values())
    if not active:
        raise NoActiveRolloutError("emit_reward/emit_event called outside any rollout")
    raise NoActiveRolloutError(
        f"{len(active)} rollouts are running in this process and this thread does not say "
        "which one it belongs to; start the thread with contextvars.copy_context().run(...) "
        "or use asyncio.to_thread, which copies the context"
    )


def emit_reward(
    value: Any, *, name: str = "reward", metadata: dict[str, Any] | None = None
) -> Reward:
    """Record a reward for the current rollout (see :meth:`RolloutContext.emit_reward`)."""
    return current_rollout().emit_reward(value, name=name, metadata=metadata)


def emit_event(name: str, **attributes: Any) -> Span:
    """Record an instantaneous event (a zero-length span) in the current rollout."""
    ctx = current_rollout()
    t = now()
    return ctx.add_span(
        Span(
            rollout_id=ctx.rollout_id,
            attempt_id=ctx.attempt_id,
            trace_id=ctx.trace_id,
            name=name,
            start_time=t,
            end_time=t,
            attributes=attributes,
            status="ok",
        )
    )


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[Span]:
    """``with vl.span("tool:search", query=q): ...`` records a timed span in the rollout."""
    return current_rollout().span(name, **attributes)


def rollout_headers(agent_name: str | None = None) -> dict[str, str]:
    """The gateway's header form for the current rollout (``x-rollout-id``, ``x-attempt-id``
    and, when given, ``x-agent-name``); empty outside a rollout.

    Clients created once and shared by concurrent rollouts send these on each request, so
    the gateway records every call against the rollout that made it.
    """
    ctx = find_rollout()
    if ctx is None:
        return {}
    headers = {"x-rollout-id": ctx.rollout_id, "x-attempt-id": ctx.attempt_id}
    if agent_name:
        headers["x-agent-name"] = agent_name
    return headers
