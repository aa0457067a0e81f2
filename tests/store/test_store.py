"""Store semantics, checked against every implementation through the ``store`` fixture."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest

from voltrl.errors import NotFoundError, StaleAttemptError
from voltrl.resources import LLM, PromptTemplate, Resources
from voltrl.store.base import Store
from voltrl.types import AttemptResult, Claim, LLMCall, Reward, Run, Span, Task, now

SHORT_LEASE = 0.05
WAKE_LIMIT_S = 10.0  # far longer than any wake-up takes; reaching it means no wake-up came


def tasks(n: int) -> list[Task]:
    return [Task(input={"i": i}, index=i) for i in range(n)]


async def claim(store: Store, worker: str = "w", lease_s: float = 30.0) -> Claim:
    c = await store.claim(worker, lease_s=lease_s)
    assert c is not None
    return c


async def expire(store: Store, lease_s: float = SHORT_LEASE) -> int:
    await asyncio.sleep(lease_s * 2)
    return await store.expire_leases()


def succeeded(reward: float | None = 1.0, **kw: object) -> AttemptResult:
    return AttemptResult(status="succeeded", reward=reward, **kw)


# ---- queue order and claiming -------------------------------------------------------------
async def test_claim_takes_oldest_queued_rollout_first(store: Store) -> None:
    rollouts = await store.enqueue(tasks(3), mode="val", max_attempts=2)
    assert [r.status for r in rollouts] == ["queued"] * 3
    claimed = [await claim(store, f"w{i}") for i in range(3)]
    assert [c.rollout.rollout_id for c in claimed] == [r.rollout_id for r in rollouts]
    first = claimed[0]
    assert first.rollout.status == "running" and first.rollout.attempt_count == 1
    assert first.rollout.started_at is not None and first.rollout.mode == "val"
    assert first.attempt.index == 1 and first.attempt.worker_id == "w0"
    assert first.attempt.status == "running" and first.attempt.lease_expires_at > now()
    assert await store.claim("w") is None


async def test_claim_on_empty_queue_returns_none_after_wait(store: Store) -> None:
    assert await store.claim("w", wait_s=0.1) is None


async def test_requeued_rollout_goes_behind_those_already_queued(store: Store) -> None:
    a, b = await store.enqueue(tasks(2))
    await claim(store, lease_s=SHORT_LEASE)
    assert await expire(store) == 1
    assert (await claim(store)).rollout.rollout_id == b.rollout_id
    again = await claim(store)
    assert again.rollout.rollout_id == a.rollout_id and again.attempt.index == 2


async def test_concurrent_claimers_never_get_the_same_rollout(store: Store) -> None:
    rollouts = await store.enqueue(tasks(60))

    async def worker(name: str) -> list[str]:
        got = []
        while (c := await store.claim(name, wait_s=0.0)) is not None:
            got.append(c.rollout.rollout_id)
            await asyncio.sleep(0)
        return got

    results = await asyncio.gather(*(worker(f"w{i}") for i in range(16)))
    claimed = [rid for got in results for rid in got]
    assert len(claimed) == len(set(claimed)) == 60
    assert set(claimed) == {r.rollout_id for r in rollouts}


async def test_claim_with_wait_wakes_when_a_task_is_enqueued(store: Store) -> None:
    waiter = asyncio.create_task(store.claim("w", wait_s=60.0))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    [r] = await store.enqueue(tasks(1))
    c = await asyncio.wait_for(waiter, WAKE_LIMIT_S)
    assert c is not None and c.rollout.rollout_id == r.rollout_id


async def test_sqlite_stores_on_one_file_claim_from_threads_without_duplicates(
    store_factory: Callable[[str], Awaitable[Store]],
) -> None:
    producer = await store_factory("sqlite")
    rollouts = await producer.enqueue(tasks(200))
    results: dict[str, list[str]] = {}
    errors: list[BaseException] = []

    def thread_main(name: str) -> None:
        async def run() -> None:
            store = await store_factory("sqlite")
            got = results.setdefault(name, [])
            try:
                while (c := await store.claim(name)) is not None:
                    got.append(c.rollout.rollout_id)
            finally:
                await store.close()

        try:
            asyncio.run(run())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=thread_main, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    await producer.close()
    assert not errors
    claimed = [rid for got in results.values() for rid in got]
    assert len(claimed) == len(set(claimed)) == 200
    assert set(claimed) == {r.rollout_id for r in rollouts}


# ---- leases and retries -------------------------------------------------------------------
async def test_expired_lease_requeues_rollout_for_a_new_attempt(store: Store) -> None:
    [r] = await store.enqueue(tasks(1))
    first = await claim(store, "w1", lease_s=SHORT_LEASE)
    assert await expire(store) == 1
    rollout = await store.get_rollout(r.rollout_id)
    assert rollout.status == "queued" and rollout.error and "lease expired" in rollout.error
    [attempt] = await store.get_attempts(r.rollout_id)
    assert attempt.attempt_id == first.attempt.attempt_id and attempt.status == "expired"
    assert attempt.finished_at is not None
    second = await claim(store, "w2")
    assert second.attempt.index == 2 and second.rollout.attempt_count == 2
    done = await store.complete(second.attempt.attempt_id, succeeded(0.5))
    assert done.status == "succeeded" and done.final_attempt_id == second.attempt.attempt_id


async def test_claim_expires_due_leases_before_claiming(store: Store) -> None:
    [r] = await store.enqueue(tasks(1))
    await claim(store, lease_s=SHORT_LEASE)
    await asyncio.sleep(SHORT_LEASE * 2)
    c = await claim(store)
    assert c.rollout.rollout_id == r.rollout_id and c.attempt.index == 2


async def test_lease_expiry_on_last_attempt_fails_rollout(store: Store) -> None:
    [r] = await store.enqueue(tasks(1), max_attempts=2)
    for _ in range(2):
        await claim(store, lease_s=SHORT_LEASE)
        assert await expire(store) == 1
    rollout = await store.get_rollout(r.rollout_id)
    assert rollout.status == "failed" and rollout.finished_at is not None
    assert rollout.attempt_count == 2
    assert [a.status for a in await store.get_attempts(r.rollout_id)] == ["expired", "expired"]
    assert await store.claim("w") is None


async def test_a_started_rollout_is_never_claimed_and_records_calls_until_completed(
    store: Store,
) -> None:
    started = await store.start_rollout(
        Task(input={"round": 1}), worker_id="apo", mode="optimizer", run_id="r", lease_s=30.0
    )
    r, a = started.rollout, started.attempt
    assert (r.status, r.mode, r.attempt_count, r.max_attempts) == ("running", "optimizer", 1, 1)
    assert await store.claim("w") is None  # runners never get it
    [call] = await store.add_llm_calls(
        [LLMCall(rollout_id=r.rollout_id, attempt_id=a.attempt_id, agent_name="apo-optimizer")]
    )
    assert call.sequence_id == 0
    done = await store.complete(a.attempt_id, succeeded(None))
    assert done.status == "succeeded" and done.final_attempt_id == a.attempt_id
    assert [c.agent_name for c in await store.get_llm_calls(r.rollout_id)] == ["apo-optimizer"]
    assert [x.rollout_id for x in await store.query_rollouts(run_id="r")] == [r.rollout_id]


async def test_a_started_rollout_whose_lease_runs_out_fails_instead_of_being_queued(
    store: Store,
) -> None:
    started = await store.start_rollout(
        Task(input={}), worker_id="apo", mode="optimizer", lease_s=SHORT_LEASE
    )
    assert await expire(store) == 1
    rollout = await store.get_rollout(started.rollout.rollout_id)
    assert rollout.status == "failed" and "lease expired" in (rollout.error or "")
    assert await store.claim("w") is None


async def test_failed_attempt_is_retried_until_max_attempts(store: Store) -> None:
    [r] = await store.enqueue(tasks(1), max_attempts=3)
    statuses = []
    for status in ("failed", "timeout", "failed"):
        c = await claim(store)
        done = await store.complete(
            c.attempt.attempt_id, AttemptResult(status=status, error=f"{status}!")
        )
        statuses.append(done.status)
    assert statuses == ["queued", "queued", "failed"]
    rollout = await store.get_rollout(r.rollout_id)
    assert rollout.error == "failed!" and rollout.finished_at is not None
    assert rollout.reward is None and rollout.final_attempt_id is None
    attempts = await store.get_attempts(r.rollout_id)
    assert [a.index for a in attempts] == [1, 2, 3]
    assert [a.status for a in attempts] == ["failed", "timeout", "failed"]


async def test_agent_error_fails_at_once_only_a_rollout_enqueued_without_its_retries(
    store: Store,
) -> None:
    [strict] = await store.enqueue(tasks(1), max_attempts=3, retry_agent_errors=False)
    [lenient] = await store.enqueue(tasks(1), max_attempts=3)
    assert not strict.retry_agent_errors and lenient.retry_agent_errors
    agent_failure = AttemptResult(status="failed", error="ValueError: bad", agent_error=True)
    released = AttemptResult(status="failed", error="released: worker w stopped")

    c = await claim(store)  # an infrastructure failure is retried all the same
    assert c.rollout.rollout_id == strict.rollout_id and not c.rollout.retry_agent_errors
    assert (await store.complete(c.attempt.attempt_id, released)).status == "queued"
    c = await claim(store)
    assert c.rollout.rollout_id == lenient.rollout_id
    assert (await store.complete(c.attempt.attempt_id, agent_failure)).status == "queued"
    c = await claim(store)
    assert c.rollout.rollout_id == strict.rollout_id
    done = await store.complete(c.attempt.attempt_id, agent_failure)
    assert done.status == "failed" and done.attempt_count == 2
    assert done.error == "ValueError: bad" and done.finished_at is not None
    assert (await store.get_rollout(strict.rollout_id)).status == "failed"


async def test_late_complete_after_lease_expiry_is_rejected_and_applies_nothing(
    store: Store,
) -> None:
    [r] = await store.enqueue(tasks(1))
    c = await claim(store, lease_s=SHORT_LEASE)
    await asyncio.sleep(SHORT_LEASE * 2)
    late = succeeded(
        rewards=[Reward(rollout_id=r.rollout_id, attempt_id=c.attempt.attempt_id, value=1.0)],
        spans=[Span(rollout_id=r.rollout_id, attempt_id=c.attempt.attempt_id, name="s")],
    )
    with pytest.raises(StaleAttemptError):
        await store.complete(c.attempt.attempt_id, late)
    rollout = await store.get_rollout(r.rollout_id)
    assert rollout.status == "queued" and rollout.reward is None
    assert await store.get_spans(r.rollout_id) == []
    assert await store.get_rewards(r.rollout_id) == []
    [attempt] = await store.get_attempts(r.rollout_id)
    assert attempt.status == "expired" and attempt.reward is None


async def test_late_complete_after_another_attempt_took_over_is_rejected(store: Store) -> None:
    [r] = await store.enqueue(tasks(1))
    old = await claim(store, "old", lease_s=SHORT_LEASE)
    await expire(store)
    new = await claim(store, "new")
    span = Span(rollout_id=r.rollout_id, attempt_id=old.attempt.attempt_id, name="late")
    with pytest.raises(StaleAttemptError):
        await store.complete(old.attempt.attempt_id, succeeded(9.0, spans=[span]))
    assert (await store.get_rollout(r.rollout_id)).status == "running"
    done = await store.complete(new.attempt.attempt_id, succeeded(1.0))
    assert done.reward == 1.0 and done.final_attempt_id == new.attempt.attempt_id
    assert await store.get_spans(r.rollout_id) == []


async def test_completing_twice_or_an_unknown_attempt_is_stale(store: Store) -> None:
    await store.enqueue(tasks(1))
    c = await claim(store)
    await store.complete(c.attempt.attempt_id, succeeded())
    with pytest.raises(StaleAttemptError):
        await store.complete(c.attempt.attempt_id, succeeded(0.0))
    with pytest.raises(StaleAttemptError):
        await store.complete("at-unknown", succeeded())
    assert (await store.get_rollout(c.rollout.rollout_id)).reward == 1.0


async def test_heartbeat_renews_lease(store: Store) -> None:
    [r] = await store.enqueue(tasks(1))
    # Leases far longer than any stall of a loaded machine: the attempt cannot expire here, so
    # what is checked is each heartbeat moving the lease on (from its own time, by its lease).
    c = await claim(store, lease_s=30.0)
    previous = c.attempt
    for _ in range(3):
        await asyncio.sleep(0.01)  # the clock moves on between heartbeats (a lower bound only)
        assert await store.heartbeat([c.attempt.attempt_id], lease_s=60.0) == []
        [attempt] = await store.get_attempts(r.rollout_id)
        assert attempt.heartbeat_at > previous.heartbeat_at
        assert attempt.lease_expires_at > previous.lease_expires_at
        assert attempt.lease_expires_at == pytest.approx(attempt.heartbeat_at + 60.0, abs=1e-3)
        previous = attempt
    assert attempt.heartbeat_at > attempt.started_at
    assert attempt.lease_expires_at > c.attempt.lease_expires_at + 29.0  # not the claim's lease
    assert await store.expire_leases() == 0
    assert (await store.complete(c.attempt.attempt_id, succeeded())).status == "succeeded"


async def test_heartbeat_reports_attempts_that_no_longer_own_their_rollout(store: Store) -> None:
    await store.enqueue(tasks(3))
    expired = await claim(store, lease_s=SHORT_LEASE)
    finished = await claim(store)
    live = await claim(store)
    await store.complete(finished.attempt.attempt_id, succeeded())
    await asyncio.sleep(SHORT_LEASE * 2)
    ids = [expired.attempt.attempt_id, finished.attempt.attempt_id, "at-unknown"]
    stale = await store.heartbeat([*ids, live.attempt.attempt_id])
    assert stale == ids


# ---- cancel -------------------------------------------------------------------------------
async def test_cancelled_queued_rollout_is_never_claimed(store: Store) -> None:
    a, b = await store.enqueue(tasks(2))
    cancelled = await store.cancel(a.rollout_id)
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    assert (await claim(store)).rollout.rollout_id == b.rollout_id
    assert await store.claim("w") is None


async def test_cancel_running_rollout_makes_its_attempt_stale(store: Store) -> None:
    [r] = await store.enqueue(tasks(1))
    c = await claim(store)
    assert (await store.cancel(r.rollout_id)).status == "cancelled"
    assert await store.heartbeat([c.attempt.attempt_id]) == [c.attempt.attempt_id]
    with pytest.raises(StaleAttemptError):
        await store.complete(c.attempt.attempt_id, succeeded())
    [attempt] = await store.get_attempts(r.rollout_id)
    assert attempt.status == "cancelled"
    rollout = await store.get_rollout(r.rollout_id)
    assert rollout.status == "cancelled" and rollout.reward is None


async def test_cancel_leaves_finished_rollout_unchanged(store: Store) -> None:
    [r] = await store.enqueue(tasks(1))
    c = await claim(store)
    done = await store.complete(c.attempt.attempt_id, succeeded(0.25))
    assert await store.cancel(r.rollout_id) == done
    with pytest.raises(NotFoundError):
        await store.cancel("ro-unknown")


# ---- waiting ------------------------------------------------------------------------------
async def test_wait_for_rollouts_wakes_when_they_complete(store: Store) -> None:
    rollouts = await store.enqueue(tasks(2))
    ids = [r.rollout_id for r in rollouts]
    waiter = asyncio.create_task(store.wait_for_rollouts(ids[::-1], timeout_s=60.0))
    for _ in ids:
        c = await claim(store)
        await asyncio.sleep(0.02)
        assert not waiter.done()
        await store.complete(c.attempt.attempt_id, succeeded())
    done = await asyncio.wait_for(waiter, WAKE_LIMIT_S)
    assert [r.rollout_id for r in done] == ids[::-1]
    assert all(r.status == "succeeded" for r in done)


async def test_wait_for_rollouts_returns_finished_ones_on_timeout(store: Store) -> None:
    a, b, c = await store.enqueue(tasks(3))
    await store.cancel(c.rollout_id)
    first = await claim(store)
    await store.complete(first.attempt.attempt_id, succeeded())
    done = await store.wait_for_rollouts([c.rollout_id, b.rollout_id, a.rollout_id], timeout_s=0.1)
    assert [r.rollout_id for r in done] == [c.rollout_id, a.rollout_id]
    assert await store.wait_for_rollouts([], timeout_s=0.1) == []


async def test_wait_for_rollouts_wakes_when_last_lease_expires(store: Store) -> None:
    [r] = await store.enqueue(tasks(1), max_attempts=1)
    await claim(store, lease_s=0.1)
    waiter = store.wait_for_rollouts([r.rollout_id], timeout_s=60.0)
    [done] = await asyncio.wait_for(waiter, WAKE_LIMIT_S)
    assert done.status == "failed" and "lease expired" in (done.error or "")


async def test_wait_for_unknown_rollout_raises_not_found(store: Store) -> None:
    [r] = await store.enqueue(tasks(1))
    with pytest.raises(NotFoundError, match="ro-nope"):
        await store.wait_for_rollouts([r.rollout_id, "ro-nope"], timeout_s=0.1)


# ---- resources and runs -------------------------------------------------------------------
async def test_resources_get_increasing_versions(store: Store) -> None:
    assert await store.get_resources() is None
    llm = LLM(endpoint="http://localhost:1/v1", model="m", sampling_parameters={"t": 0.7})
    first = Resources(items={"main_llm": llm})
    v1 = await store.add_resources(first)
    v2 = await store.add_resources(Resources(items={"p": PromptTemplate(template="{x}!")}))
    assert (v1.version, v2.version, first.version) == (1, 2, 0)
    assert await store.get_resources() == v2
    assert await store.get_resources(1) == v1
    assert (await store.get_resources(1))["main_llm"] == llm
    assert await store.get_resources(3) is None
    assert await store.get_resources(0) is None


async def test_runs_are_listed_oldest_first(store: Store) -> None:
    later = Run(name="b", kind="dev", created_at=now() + 10)
    earlier = Run(name="a", kind="fit", algorithm="grpo", config={"lr": 1e-5})
    assert await store.add_run(later) == later
    await store.add_run(earlier)
    assert await store.list_runs() == [earlier, later]
    renamed = later.model_copy(update={"name": "b2"})
    await store.add_run(renamed)
    assert await store.list_runs() == [earlier, renamed]


# ---- records ------------------------------------------------------------------------------
def call(c: Claim, **kw: object) -> LLMCall:
    return LLMCall(rollout_id=c.rollout.rollout_id, attempt_id=c.attempt.attempt_id, **kw)


async def test_llm_call_sequence_ids_count_per_attempt(store: Store) -> None:
    [r] = await store.enqueue(tasks(1))
    first = await claim(store, lease_s=SHORT_LEASE)
    saved = await store.add_llm_calls(
        [call(first, prompt_token_ids=[1, 2], response_token_ids=[3], sequence_id=7), call(first)]
    )
    assert [c.sequence_id for c in saved] == [0, 1]
    await expire(store)
    second = await claim(store)
    [other] = await store.add_llm_calls([call(second, response_logprobs=[-0.5])])
    assert other.sequence_id == 0
    assert [c.sequence_id for c in await store.add_llm_calls([call(first)])] == [2]
    everything = await store.get_llm_calls(r.rollout_id)
    assert [(c.attempt_id, c.sequence_id) for c in everything] == [
        (first.attempt.attempt_id, 0),
        (first.attempt.attempt_id, 1),
        (second.attempt.attempt_id, 0),
        (first.attempt.attempt_id, 2),
    ]
    assert everything[0].prompt_token_ids == [1, 2] and everything[0].has_token_ids
    assert await store.get_llm_calls(r.rollout_id, second.attempt.attempt_id) == [other]


async def test_span_sequence_ids_continue_from_add_spans_into_complete(store: Store) -> None:
    [r] = await store.enqueue(tasks(1))
    c = await claim(store)
    aid = c.attempt.attempt_id

    def span(name: str, **kw: object) -> Span:
        return Span(rollout_id=r.rollout_id, attempt_id=aid, name=name, **kw)

    added = await store.add_spans([span("a"), span("b", sequence_id=100)])
    assert [s.sequence_id for s in added] == [0, 100]
    elsewhere = Span(rollout_id="ro-elsewhere", attempt_id="at-x", name="c")
    await store.complete(aid, succeeded(spans=[elsewhere, span("d", attributes={"k": [1, 2]})]))
    spans = await store.get_spans(r.rollout_id, aid)
    assert [(s.name, s.sequence_id) for s in spans] == [("a", 0), ("b", 100), ("c", 1), ("d", 2)]
    assert all(s.rollout_id == r.rollout_id and s.attempt_id == aid for s in spans)
    assert spans[-1].attributes == {"k": [1, 2]}
    assert await store.get_spans(r.rollout_id, "at-other") == []


async def test_records_of_unknown_rollout_raise_not_found(store: Store) -> None:
    for attempt in (
        store.add_llm_calls([LLMCall(rollout_id="ro-x", attempt_id="at-x")]),
        store.add_spans([Span(rollout_id="ro-x", attempt_id="at-x", name="s")]),
        store.add_rewards([Reward(rollout_id="ro-x", attempt_id="at-x", value=1.0)]),
        store.get_rollout("ro-x"),
        store.get_attempts("ro-x"),
        store.get_llm_calls("ro-x"),
        store.get_spans("ro-x"),
        store.get_rewards("ro-x"),
    ):
        with pytest.raises(NotFoundError, match="ro-x"):
            await attempt


async def test_final_reward_is_returned_reward_else_last_emitted(store: Store) -> None:
    returned, emitted, none = await store.enqueue(tasks(3))
    for r, reward, values in ((returned, 0.9, [0.1, 0.2]), (emitted, None, [0.3, 0.4])):
        c = await claim(store)
        assert c.rollout.rollout_id == r.rollout_id
        rewards = [
            Reward(rollout_id="x", attempt_id="y", value=v, step=i) for i, v in enumerate(values)
        ]
        done = await store.complete(c.attempt.attempt_id, succeeded(reward, rewards=rewards))
        saved = await store.get_rewards(r.rollout_id, c.attempt.attempt_id)
        assert [(rw.value, rw.step, rw.attempt_id) for rw in saved] == [
            (v, i, c.attempt.attempt_id) for i, v in enumerate(values)
        ]
        assert done.reward == (reward if reward is not None else values[-1])
        assert (await store.get_attempts(r.rollout_id))[0].reward == done.reward
    c = await claim(store)
    assert (await store.complete(c.attempt.attempt_id, succeeded(None))).reward is None
    extra = Reward(rollout_id=none.rollout_id, attempt_id="at-otlp", value=2.0, source="span")
    await store.add_rewards([extra])
    assert await store.get_rewards(none.rollout_id) == [extra]


async def test_complete_records_transitions_and_error_on_the_attempt(store: Store) -> None:
    from voltrl.types import Transition

    await store.enqueue(tasks(1))
    c = await claim(store)
    t = Transition(prompt_token_ids=[1], response_token_ids=[2, 3], reward=1.0)
    result = AttemptResult(status="succeeded", reward=1.0, transitions=[t], error=None)
    await store.complete(c.attempt.attempt_id, result)
    [attempt] = await store.get_attempts(c.rollout.rollout_id)
    assert attempt.status == "succeeded" and attempt.transitions == [t]
    assert attempt.finished_at is not None


# ---- queries ------------------------------------------------------------------------------
@pytest.mark.slow
async def test_query_rollouts_filters_and_orders_oldest_first(store: Store) -> None:
    t0 = now()
    train = await store.enqueue(tasks(3), run_id="run-a")
    await asyncio.sleep(0.01)
    t1 = now()
    val = await store.enqueue(tasks(2), run_id="run-b", mode="val")
    c = await claim(store)
    await store.complete(c.attempt.attempt_id, succeeded())
    running = await claim(store)
    ids = lambda rs: [r.rollout_id for r in rs]  # noqa: E731

    assert ids(await store.query_rollouts()) == ids(train + val)
    assert ids(await store.query_rollouts(run_id="run-b")) == ids(val)
    assert ids(await store.query_rollouts(mode="val")) == ids(val)
    assert ids(await store.query_rollouts(status="succeeded")) == [c.rollout.rollout_id]
    assert ids(await store.query_rollouts(status=["succeeded", "running"])) == ids(train[:2])
    assert ids(await store.query_rollouts(status="queued", run_id="run-a")) == ids(train[2:])
    assert ids(await store.query_rollouts(since=t1)) == ids(val)
    assert ids(await store.query_rollouts(since=t0, until=t1)) == ids(train)
    assert ids(await store.query_rollouts(limit=2)) == ids(train[:2])
    picked = [val[1].rollout_id, running.rollout.rollout_id, "ro-missing", val[1].rollout_id]
    assert ids(await store.query_rollouts(rollout_ids=picked)) == picked[1::-1]
    assert await store.query_rollouts(rollout_ids=[]) == []
    assert await store.query_rollouts(run_id="run-none") == []
    many = [r.rollout_id for r in await store.enqueue(tasks(1000))]
    got = await store.query_rollouts(rollout_ids=many[::-1], limit=999)
    assert ids(got) == many[:999]


# ---- a cancellation is never lost ---------------------------------------------------------
async def test_a_waiter_cancelled_as_a_change_wakes_it_is_cancelled() -> None:
    """Python 3.11's ``asyncio.wait_for`` returned the result of a future done by the time a
    cancellation reached it: a Ctrl-C that landed right after a store change was lost, and
    LocalRL went on training."""
    from voltrl.store.lifecycle import Notifier

    changes = Notifier()
    waiter = asyncio.create_task(changes.wait(WAKE_LIMIT_S))
    while not changes._waiters:  # a state, polled: the waiter has registered
        await asyncio.sleep(0)
    changes.notify()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_a_write_cancelled_before_its_group_commits_is_kept_and_still_cancelled(
    tmp_path,
) -> None:
    """With grouped commits (``voltrl serve``) a cancelled write waits for its group's commit,
    then ends cancelled: its change is kept and the cancellation is not swallowed."""
    from voltrl.store.sql import SQLStore

    store = SQLStore(tmp_path / "store.sqlite")
    store.group_commits()
    try:
        write = asyncio.create_task(store.enqueue(tasks(1), mode="train"))
        while store._db.group is None:  # a state, polled: written, its group not committed
            await asyncio.sleep(0)
        write.cancel()
        with pytest.raises(asyncio.CancelledError):
            await write
        assert [r.status for r in await store.query_rollouts()] == ["queued"]
    finally:
        await store.close()
