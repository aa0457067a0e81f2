"""The agent API: subclass :class:`LitAgent`, or decorate a function with :func:`rollout`.

A rollout receives the task's input (the dataset row, a dict), the resources it runs with
(LLMs already scoped to this rollout, so calls through the gateway are recorded against it)
and, if it takes a third parameter, the :class:`~voltrl.tracing.RolloutContext`. It returns

- a number: the rollout's reward;
- ``None``: the reward is the last one emitted with ``emit_reward`` (or none at all);
- a list of :class:`~voltrl.types.Transition` (or a :class:`~voltrl.types.Trajectory`):
  explicit training data, used instead of the recorded LLM calls.

Sync rollouts run in a thread of their own, async ones on the worker's event loop. A sync
rollout that is timed out or cancelled leaves its thread running, abandoned (see
:func:`run_in_thread`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import numbers
import threading
from collections.abc import Callable
from typing import Any, Literal, get_type_hints

from voltrl.errors import InvalidRolloutResultError, UnknownResourceError
from voltrl.resources import LLM, PromptTemplate, Resources
from voltrl.tracing import RolloutContext, check_reward
from voltrl.types import Trajectory, Transition


class LitAgent:
    """Base class of agents. Override ``rollout`` (sync or async); optionally
    ``training_rollout`` / ``validation_rollout`` for mode-specific behaviour, and the
    ``on_rollout_start`` / ``on_rollout_end`` hooks (sync or async)."""

    name: str | None = None

    def rollout(self, task: dict[str, Any], resources: Resources, ctx: RolloutContext) -> Any:
        """Run the agent on one task. Override this (``def`` or ``async def``)."""
        raise NotImplementedError(f"{type(self).__name__} must override rollout()")

    def training_rollout(
        self, task: dict[str, Any], resources: Resources, ctx: RolloutContext
    ) -> Any:
        """The rollout used while training (mode ``train``); defaults to :meth:`rollout`."""
        return _call_flexibly(self.rollout, task, resources, ctx)

    def validation_rollout(
        self, task: dict[str, Any], resources: Resources, ctx: RolloutContext
    ) -> Any:
        """The rollout used for validation and ``dev``; defaults to :meth:`rollout`."""
        return _call_flexibly(self.rollout, task, resources, ctx)

    def on_rollout_start(
        self, task: dict[str, Any], resources: Resources, ctx: RolloutContext
    ) -> Any:
        """Called before each rollout, in the rollout's context."""

    def on_rollout_end(self, task: dict[str, Any], result: Any, ctx: RolloutContext) -> Any:
        """Called after each rollout that returned (not after one that raised)."""

    @property
    def agent_name(self) -> str:
        """The agent's name: ``name`` if set, else its class name."""
        return self.name or type(self).__name__


def _call_flexibly(fn: Callable[..., Any], task: Any, resources: Any, ctx: Any) -> Any:
    """Call ``fn(task, resources[, ctx])`` according to how many parameters it takes."""
    return fn(task, resources, ctx) if _n_params(fn) >= 3 else fn(task, resources)


def _n_params(fn: Callable[..., Any]) -> int:
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 3
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _is_async(agent: LitAgent, method: str) -> bool:
    """Whether ``method`` (or the ``rollout`` it defaults to) is a coroutine function."""
    own = getattr(type(agent), method)
    if own is getattr(LitAgent, method):
        own = type(agent).rollout
    return inspect.iscoroutinefunction(own) or inspect.iscoroutinefunction(getattr(agent, method))


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def run_rollout(
    agent: LitAgent,
    ctx: RolloutContext,
    *,
    on_abandon: Callable[[threading.Thread], None] | None = None,
) -> Any:
    """Run one rollout of ``agent`` with hooks, sync methods in a thread of their own
    (``on_abandon``: see :func:`run_in_thread`)."""
    method = "training_rollout" if ctx.mode == "train" else "validation_rollout"
    task = ctx.task.input
    await _maybe_await(agent.on_rollout_start(task, ctx.resources, ctx))
    fn = getattr(agent, method)
    if _is_async(agent, method):
        result = await _maybe_await(_call_flexibly(fn, task, ctx.resources, ctx))
    else:
        args = (_call_flexibly, fn, task, ctx.resources, ctx)
        result = await run_in_thread(*args, on_abandon=on_abandon)
    await _maybe_await(agent.on_rollout_end(task, result, ctx))
    return result


async def run_in_thread(
    fn: Callable[..., Any],
    *args: Any,
    on_abandon: Callable[[threading.Thread], None] | None = None,
) -> Any:
    """Run ``fn(*args)`` in a new daemon thread with the caller's context.

    If the awaiting task is cancelled (timeout, lost lease, shutdown), the cancellation takes
    effect at once and the thread is abandoned: nothing is raised inside it, since an
    exception at an arbitrary instruction could break whatever library it is in (a lock left
    held, half-written state). It runs on until its code returns; what it then returns or
    raises is dropped, and rewards or spans it emits are rejected (its rollout has finished).
    ``on_abandon`` is told about each thread abandoned while still running.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()
    ctx = contextvars.copy_context()

    def settle(value: Any, exc: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(_settle, fut, value, exc)

    def target() -> None:
        try:
            value = ctx.run(fn, *args)
        except BaseException as exc:
            settle(None, exc)
        else:
            settle(value, None)

    thread = threading.Thread(target=target, name="voltrl-rollout", daemon=True)
    thread.start()
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.cancel()  # what the thread ends with is dropped (and never logged as unretrieved)
        if thread.is_alive() and on_abandon is not None:
            on_abandon(thread)
        raise


def _settle(fut: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def normalize_result(value: Any, rollout_id: str) -> tuple[float | None, list[Transition] | None]:
    """Split what a rollout returned into (reward, explicit transitions), or raise
    :class:`InvalidRolloutResultError` naming the rollout."""
    if value is None:
        return None, None
    if isinstance(value, Trajectory):
        return value.reward, value.transitions
    if isinstance(value, list) and all(isinstance(t, Transition) for t in value):
        rewards = [t.reward for t in value if t.reward is not None]
        return (rewards[-1] if rewards else None), value
    if isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
        return check_reward(float(value), rollout_id), None
    raise InvalidRolloutResultError(
        f"rollout returned {type(value).__name__} {value!r:.80}; return a number (the reward), "
        "None (rewards emitted with emit_reward), or a list of Transition",
        rollout_id,
    )


# ---- function agents ---------------------------------------------------------------------

ResourceKind = Literal["llm", "resources", "prompt_template"]


class FunctionAgent(LitAgent):
    """A :class:`LitAgent` wrapping a function ``(task, llm | resources | prompt_template)``."""

    def __init__(self, fn: Callable[..., Any], kind: ResourceKind, resource_name: str | None):
        self.fn = fn
        self.kind = kind
        self.resource_name = resource_name
        self.name = getattr(fn, "__name__", None)
        self._async = inspect.iscoroutinefunction(fn)
        self._wants_ctx = _n_params(fn) >= 3

    def _pick(self, resources: Resources) -> Any:
        if self.kind == "resources":
            return resources
        cls = LLM if self.kind == "llm" else PromptTemplate
        if self.resource_name is not None:
            item = resources[self.resource_name]
            if not isinstance(item, cls):
                raise UnknownResourceError(
                    f"resource {self.resource_name!r} is a {type(item).__name__}, "
                    f"not {cls.__name__}"
                )
            return item
        found = resources.of_kind(cls)
        if len(found) == 1:
            return next(iter(found.values()))
        if "main_llm" in found and cls is LLM:
            return found["main_llm"]
        raise UnknownResourceError(
            f"{self.name} takes one {cls.__name__} but resources version {resources.version} has "
            f"{sorted(found) or 'none'}; name one with @rollout(resource='...')"
        )

    def rollout(self, task: dict[str, Any], resources: Resources, ctx: RolloutContext) -> Any:
        """Call the wrapped function with the resource it asks for."""
        arg = self._pick(resources)
        return self.fn(task, arg, ctx) if self._wants_ctx else self.fn(task, arg)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class AsyncFunctionAgent(FunctionAgent):
    """A :class:`FunctionAgent` around an ``async def``."""

    async def rollout(  # type: ignore[override]
        self, task: dict[str, Any], resources: Resources, ctx: RolloutContext
    ) -> Any:
        """Await the wrapped coroutine function with the resource it asks for."""
        return await super().rollout(task, resources, ctx)


def _resource_kind(fn: Callable[..., Any]) -> ResourceKind:
    params = list(inspect.signature(fn).parameters.values())
    if len(params) < 2:
        raise TypeError(
            f"@rollout function {fn.__name__} must take (task, llm), (task, resources) or "
            "(task, prompt_template), optionally followed by ctx"
        )
    second = params[1]
    try:
        hint = get_type_hints(fn).get(second.name)
    except Exception:  # unresolvable annotations: fall back to the name
        hint = None
    if hint is LLM or second.name == "llm":
        return "llm"
    if hint is PromptTemplate or second.name in ("prompt_template", "prompt"):
        return "prompt_template"
    if hint is Resources or second.name == "resources":
        return "resources"
    raise TypeError(
        f"@rollout cannot tell what {fn.__name__}'s second parameter {second.name!r} wants: "
        "name it llm, resources or prompt_template, or annotate it with that type"
    )


def rollout(
    fn: Callable[..., Any] | None = None, *, resource: str | None = None
) -> FunctionAgent | Callable[[Callable[..., Any]], FunctionAgent]:
    """Turn ``(task, llm)``, ``(task, resources)`` or ``(task, prompt_template)`` functions,
    sync or async, into an agent. ``resource`` names which LLM/template to pass when the
    resources hold several."""

    def wrap(f: Callable[..., Any]) -> FunctionAgent:
        kind = _resource_kind(f)
        cls = AsyncFunctionAgent if inspect.iscoroutinefunction(f) else FunctionAgent
        return cls(f, kind, resource)

    return wrap(fn) if fn is not None else wrap
