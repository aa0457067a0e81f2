"""Rewards, events and spans from anywhere inside a rollout.

The runner activates a :class:`RolloutContext` around each rollout. ``emit_reward`` finds it
through a context variable, and only there: it works in the agent's code, in asyncio tasks it
creates, and in threads that carry the rollout's context (``asyncio.to_thread``,
``loop.run_in_executor`` on a runner worker's loop, whose default executor copies the context
like :class:`ContextThreadPoolExecutor`, or a thread started as
``threading.Thread(target=contextvars.copy_context().run, args=(fn, ...))``). A bare
``threading.Thread`` does not inherit context variables, and no rollout is guessed for it:
the call raises :class:`~voltrl.errors.NoActiveRolloutError`, which says how to pass the
context on.

What is emitted is buffered on the context and reported with the attempt's result in one
store write, so a reward from an attempt that lost its lease is never applied. Once its
rollout has finished (returned, raised, timed out or been cancelled), a context takes nothing
more: a thread that outlives its rollout and emits a reward gets
:class:`~voltrl.errors.NoActiveRolloutError`, so the reward is neither lost silently nor
credited to another rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import numbers
import re
import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from voltrl.errors import InvalidRewardError, NoActiveRolloutError
from voltrl.resources import Resources
from voltrl.types import Reward, RolloutMode, Span, Task, new_id, now

_T = TypeVar("_T")

_current_span: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "voltrl_span", default=None
)
"""The attempt and span id of the innermost :meth:`RolloutContext.span` open here."""
_current: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar(
    "voltrl_rollout", default=None
)


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
    _finished: bool = field(default=False, repr=False)

    @property
    def finished(self) -> bool:
        """Whether the rollout has finished; a finished context takes no rewards or spans."""
        return self._finished

    def finish(self) -> None:
        """Close the context (:func:`activate` does it when its block ends): from now on
        rewards and spans sent to it raise :class:`~voltrl.errors.NoActiveRolloutError`."""
        with self._lock:
            self._finished = True

    def emit_reward(
        self,
        value: Any,
        *,
        name: str = "reward",
        metadata: dict[str, Any] | None = None,
        agents: str | None = None,
    ) -> Reward:
        """Record a reward now. The last one emitted is the rollout's reward unless the
        agent returns one; earlier ones are per-step rewards for credit assignment.
        ``agents`` (a regex fully matching agent names) makes it instead the final reward of
        those agents' calls, e.g. each team's outcome in a game (see
        :func:`voltrl.trajectory.credit.agent_final_rewards`). Raises
        :class:`~voltrl.errors.NoActiveRolloutError` once the rollout has finished."""
        meta = dict(metadata or {})
        if agents is not None:
            meta["agents"] = agents
        if "agents" in meta:
            if not isinstance(meta["agents"], str):
                raise ValueError(f"agents must be a regex string, got {meta['agents']!r}")
            try:
                re.compile(meta["agents"])
            except re.error as e:
                raise ValueError(f"agents is not a valid regex: {e}") from None
        reward = Reward(
            rollout_id=self.rollout_id,
            attempt_id=self.attempt_id,
            value=check_reward(value, self.rollout_id),
            name=name,
            source="emit",
            metadata=meta,
        )
        with self._lock:
            if self._finished:
                raise self._finished_error("reward")
            self.rewards.append(reward)
        return reward

    def add_span(self, span: Span) -> Span:
        """Record a finished span of this rollout. Raises
        :class:`~voltrl.errors.NoActiveRolloutError` once the rollout has finished."""
        if not self.add_span_if_running(span):
            raise self._finished_error("span")
        return span

    def add_span_if_running(self, span: Span) -> bool:
        """Record ``span`` unless the rollout has finished; returns whether it was recorded.
        For framework hooks, which must not raise into the framework (they count drops)."""
        with self._lock:
            if self._finished:
                return False
            self.spans.append(span)
        return True

    def _finished_error(self, what: str) -> NoActiveRolloutError:
        return NoActiveRolloutError(
            f"rollout {self.rollout_id} (attempt {self.attempt_id}) has finished, so this "
            f"{what} is rejected: it comes from code that outlived the rollout (a thread still "
            "running after the rollout returned, timed out or was cancelled); wait for your "
            "threads before the rollout returns"
        )

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Span]:
        """Time a block as a span. It ends ``ok`` unless the block set ``span.status`` itself
        or raised, which marks it ``error`` (the exception is re-raised). A span opened inside
        another (in the same task, or a task started inside it) is its child.

        A span that ends after its rollout finished is rejected
        (:class:`~voltrl.errors.NoActiveRolloutError`), unless the block raised: then the
        span is dropped and the block's own exception propagates unchanged."""
        parent = _current_span.get()
        span = Span(
            rollout_id=self.rollout_id,
            attempt_id=self.attempt_id,
            trace_id=self.trace_id,
            parent_id=parent[1] if parent is not None and parent[0] == self.attempt_id else None,
            name=name,
            attributes=attributes,
        )
        entered = _current_span.set((self.attempt_id, span.span_id))
        raised = False
        try:
            yield span
            if span.status == "unset":
                span.status = "ok"
        except BaseException as exc:
            raised = True
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
            _current_span.reset(entered)
            span.end_time = now()
            if raised:
                # the block's error says what went wrong; that the rollout ended meanwhile
                # (it was cancelled or timed out, say) would hide it
                self.add_span_if_running(span)
            else:
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
    """Make ``ctx`` the current rollout for this block (the runner does this); when the
    block ends the rollout has finished and ``ctx`` takes nothing more
    (:meth:`RolloutContext.finish`), even from threads that still hold a copy of it."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        ctx.finish()
        _current.reset(token)


def find_rollout() -> RolloutContext | None:
    """The rollout this code runs for, from its context only, or None: outside a rollout,
    in a thread that was not given the rollout's context, or once that rollout finished."""
    ctx = _current.get()
    return ctx if ctx is not None and not ctx.finished else None


def current_rollout() -> RolloutContext:
    """The rollout this code runs for (see :func:`find_rollout`); raises
    :class:`NoActiveRolloutError` saying how to pass the context on, or that the rollout
    has finished, when there is none."""
    ctx = _current.get()
    if ctx is None:
        raise NoActiveRolloutError(
            "no rollout in this context: emit_reward, emit_event and span work inside a "
            "rollout, in asyncio tasks it creates and in threads given its context. Run "
            "threads with asyncio.to_thread(fn, ...), which copies the context, or start them "
            "as threading.Thread(target=contextvars.copy_context().run, args=(fn, ...)); a "
            "bare threading.Thread or a thread pool's worker does not know its rollout"
        )
    if ctx.finished:
        raise ctx._finished_error("call")
    return ctx


class ContextThreadPoolExecutor(ThreadPoolExecutor):
    """A thread pool that runs each call in a copy of the caller's context, as
    ``asyncio.to_thread`` does. Runner workers make it their event loop's default executor,
    so ``loop.run_in_executor(None, fn)`` (how AutoGen runs sync tools) keeps the rollout."""

    replaced: ThreadPoolExecutor | None = None
    """The loop's executor before this one (kept so that its threads live on)."""

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        """Schedule ``fn(*args, **kwargs)`` in a copy of the current context."""
        return super().submit(contextvars.copy_context().run, fn, *args, **kwargs)


def copy_context_into_executor(loop: asyncio.AbstractEventLoop) -> None:
    """Make ``loop``'s default executor a :class:`ContextThreadPoolExecutor` unless it is one
    already. The executor it replaces is kept alive by the new one: an executor that is
    garbage-collected ends its threads, and a child process started from one of them with a
    parent-death signal (Ray's, when ``ray.init`` ran in ``asyncio.to_thread``) would die
    with it."""
    previous = getattr(loop, "_default_executor", None)
    if isinstance(previous, ContextThreadPoolExecutor):
        return
    executor = ContextThreadPoolExecutor(thread_name_prefix="voltrl-executor")
    executor.replaced = previous
    loop.set_default_executor(executor)


def emit_reward(
    value: Any,
    *,
    name: str = "reward",
    metadata: dict[str, Any] | None = None,
    agents: str | None = None,
) -> Reward:
    """Record a reward for the current rollout (see :meth:`RolloutContext.emit_reward`;
    ``agents``: the final reward of the calls of the agents this regex fully matches)."""
    return current_rollout().emit_reward(value, name=name, metadata=metadata, agents=agents)


def emit_event(name: str, **attributes: Any) -> Span:
    """Record an instantaneous event (a zero-length span) in the current rollout: how it
    ended, say. The dashboard shows it and filters rollouts on it; LocalRL logs the mean of
    its numbers and booleans as step metrics (:mod:`voltrl.observability.events`)."""
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
    and, when given, ``x-agent-name``); empty where :func:`find_rollout` finds none.

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
