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


def test_emit_reward_from_a_bare_thread_uses_the_only_active_rollout():
    c = ctx("ro-b")
    with activate(c):
        t = threading.Thread(target=vl.emit_reward, args=(0.5,))
        t.start()
        t.join()
    assert [r.value for r in c.rewards] == [0.5]


def test_emit_reward_from_a_bare_thread_is_ambiguous_with_two_rollouts():
    a, b = ctx("ro-1"), ctx("ro-2")
    errors: list[BaseException] = []

    def work():
        try:
            vl.emit_reward(1.0)
        except BaseException as e:
            errors.append(e)

    ctx_a, ctx_b = contextvars.Context(), contextvars.Context()
    cm_a, cm_b = activate(a), activate(b)
    ctx_a.run(cm_a.__enter__)  # two rollouts active in this process,
    ctx_b.run(cm_b.__enter__)  # neither of them in this thread's context
    try:
        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert isinstance(errors[0], vl.NoActiveRolloutError)
        assert "copy_context" in str(errors[0])
        # started with a copy of its rollout's context, the thread knows which one it is
        t = threading.Thread(target=ctx_a.copy().run, args=(vl.emit_reward, 2.0))
        t.start()
        t.join()
        assert [r.value for r in a.rewards] == [2.0]
    finally:
        ctx_a.run(cm_a.__exit__, None, None, None)
        ctx_b.run(cm_b.__exit__, None, None, None)


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
