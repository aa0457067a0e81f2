"""emit_reward and spans from anywhere inside a rollout."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest
from helpers import context as ctx

import voltrl as vl
from voltrl.tracing import activate


def test_emit_reward_outside_a_rollout_raises():
    with pytest.raises(vl.NoActiveRolloutError):
        vl.emit_reward(1.0)


async def test_emit_reward_works_from_tasks_and_to_thread():
    c = ctx("ro-a")
    with activate(c):
        await asyncio.create_task(asyncio.sleep(0, result=vl.emit_reward(0.1)))

        async def inner():
            vl.emit_reward(0.2)

        await asyncio.gather(asyncio.create_task(inner()))
        await asyncio.to_thread(vl.emit_reward, 0.3)
    assert [r.value for r in c.rewards] == [0.1, 0.2, 0.3]
    assert all(r.rollout_id == "ro-a" and r.attempt_id == "at-ro-a" for r in c.rewards)


def run_in_thread(target, *args):
    """Run ``target(*args)`` in a new thread; what it raised (a NoActiveRolloutError), or None."""
    errors: list[vl.NoActiveRolloutError] = []

    def work():
        try:
            target(*args)
        except vl.NoActiveRolloutError as e:
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    return errors[0] if errors else None


def test_a_bare_thread_gets_no_rollout_even_when_only_one_runs():
    c = ctx("ro-b")
    headers: list[dict[str, str]] = []
    with activate(c):
        error = run_in_thread(vl.emit_reward, 0.5)
        run_in_thread(lambda: headers.append(vl.rollout_headers()))
    assert c.rewards == [] and headers == [{}]
    assert isinstance(error, vl.NoActiveRolloutError)
    assert "asyncio.to_thread" in str(error) and "copy_context().run" in str(error)


def test_a_thread_started_with_a_copy_of_its_rollouts_context_rewards_that_rollout():
    a, b = ctx("ro-1"), ctx("ro-2")
    ctx_a, ctx_b = contextvars.Context(), contextvars.Context()
    cm_a, cm_b = activate(a), activate(b)
    ctx_a.run(cm_a.__enter__)  # two rollouts running in this process
    ctx_b.run(cm_b.__enter__)
    try:
        assert run_in_thread(ctx_a.copy().run, vl.emit_reward, 2.0) is None
    finally:
        ctx_a.run(cm_a.__exit__, None, None, None)
        ctx_b.run(cm_b.__exit__, None, None, None)
    assert [r.value for r in a.rewards] == [2.0] and b.rewards == []


def test_a_thread_that_outlives_its_rollout_cannot_emit_into_it():
    c = ctx("ro-late")
    with activate(c):
        leftover = contextvars.copy_context()  # what a thread started in the rollout holds
    for late in (
        lambda: vl.emit_reward(1.0),
        lambda: vl.emit_event("late"),
        lambda: vl.span("late").__enter__(),
    ):
        error = run_in_thread(leftover.run, late)
        assert "rollout ro-late (attempt at-ro-late) has finished" in str(error)
    assert leftover.run(vl.find_rollout) is None and leftover.run(vl.rollout_headers) == {}
    assert (c.rewards, c.spans) == ([], [])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1", None])
def test_emit_reward_rejects_non_finite_or_non_numbers_naming_the_rollout(bad):
    c = ctx("ro-nan")
    with activate(c), pytest.raises(vl.InvalidRewardError, match="rollout ro-nan"):
        vl.emit_reward(bad)
    assert c.rewards == []


def test_span_records_timing_status_and_errors():
    c = ctx("ro-s")
    with activate(c):
        with vl.span("tool:add", a=1):
            pass
        with pytest.raises(ZeroDivisionError), vl.span("tool:div"):
            raise ZeroDivisionError("division by zero")
        vl.emit_event("checkpoint", step=3)
    ok, err, ev = c.spans
    assert (ok.name, ok.status, ok.attributes) == ("tool:add", "ok", {"a": 1})
    assert err.status == "error" and "ZeroDivisionError" in err.events[0]["message"]
    assert ev.attributes == {"step": 3} and ev.start_time == ev.end_time


def test_a_span_whose_rollout_ended_meanwhile_lets_the_blocks_own_exception_through():
    """The block raised after its rollout finished (a cancelled or timed-out rollout's thread,
    say): its exception propagates unchanged, not a NoActiveRolloutError about the span."""
    c = ctx("ro-ended")
    with activate(c), pytest.raises(KeyError) as raised, vl.span("tool:lookup"):
        c.finish()  # the rollout ends while the block runs
        raise KeyError("missing")
    assert raised.value.args == ("missing",) and c.spans == []
    # a span whose block ends cleanly after its rollout finished is still rejected
    later = ctx("ro-ended-2")
    rejected = pytest.raises(vl.NoActiveRolloutError, match="has finished")
    with activate(later), rejected, vl.span("tool:late"):
        later.finish()
    assert later.spans == []


@pytest.mark.slow
async def test_replacing_the_loops_executor_keeps_its_threads_and_their_children_alive():
    """A child started from an executor thread with a parent-death signal (as Ray starts its
    processes when ``ray.init`` runs in ``asyncio.to_thread``) outlives the executor being
    replaced by a runner worker's context-copying one."""
    import ctypes
    import gc
    import signal
    import subprocess
    import sys
    import weakref

    from voltrl.tracing import copy_context_into_executor

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1

    def start_child() -> tuple[subprocess.Popen[bytes], threading.Thread]:
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"],
            preexec_fn=lambda: libc.prctl(pr_set_pdeathsig, signal.SIGKILL),
        )
        return child, threading.current_thread()

    child, thread = await asyncio.to_thread(start_child)
    loop = asyncio.get_running_loop()
    replaced = weakref.ref(loop._default_executor)  # type: ignore[attr-defined]
    try:
        copy_context_into_executor(loop)
        gc.collect()
        # An executor ends its threads when it is collected or shut down (and a thread that
        # ended would take the child with it): the one replaced is neither, so nothing tells
        # the thread that started the child to end.
        executor = replaced()
        assert executor is not None and not executor._shutdown
        assert thread.is_alive() and child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_a_reward_for_some_agents_carries_their_pattern():
    c = ctx("r1")
    with activate(c):
        rw = vl.emit_reward(1.0, name="outcome", agents="wolves/.*")
        with pytest.raises(ValueError, match="agents is not a valid regex"):
            vl.emit_reward(1.0, agents="(")
    assert rw.metadata == {"agents": "wolves/.*"} and c.rewards == [rw]


def test_an_agents_pattern_given_in_metadata_is_checked_too():
    with activate(ctx("r2")), pytest.raises(ValueError, match="must be a regex string"):
        vl.emit_reward(1.0, metadata={"agents": ["a", "b"]})


async def test_spans_opened_inside_a_span_are_its_children():
    c = ctx("ro-tree")
    with activate(c):
        with vl.span("agent") as agent:
            with vl.span("tool:search") as search:
                pass

            async def step() -> None:
                with vl.span("tool:fetch"):
                    pass

            await asyncio.gather(step(), step())  # tasks started inside the span
        with vl.span("after") as after:
            pass
    spans = {s.span_id: s for s in c.spans}
    assert agent.parent_id is None and after.parent_id is None
    assert search.parent_id == agent.span_id
    fetches = [s for s in spans.values() if s.name == "tool:fetch"]
    assert len(fetches) == 2 and all(s.parent_id == agent.span_id for s in fetches)
