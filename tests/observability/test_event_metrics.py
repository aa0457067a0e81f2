"""What a rollout records of how it ended (``vl.emit_event``) becomes step metrics: a number's
or boolean's mean; the final attempt's events of succeeded rollouts only; and LocalRL logs
them for each step and each validation, whose versions the dashboard names."""

from __future__ import annotations

import asyncio
from pathlib import Path

from helpers import version_labels
from local_rl_setup import make_algorithm
from rl_agents import ROWS

import voltrl as vl
from voltrl.observability.events import (
    Event,
    event_metrics,
    events,
    rollout_events,
)
from voltrl.store.sql import SQLStore
from voltrl.types import AttemptResult, Span, Task


def test_numbers_and_booleans_are_averaged_and_the_rest_left_out() -> None:
    found = [
        Event("game", {"winner": "wolves", "rounds": 3, "legal": 0.5, "cap": True}),
        Event("game", {"winner": "village", "rounds": 5, "legal": None, "cap": False}),
        Event("game", {"winner": "wolves", "rounds": 4, "log": [1, 2], "roles": {"a": 1}}),
        Event("turn", {"rounds": 9.0, "ratio": float("nan")}),
    ]
    assert event_metrics(found) == {
        "game.cap": 0.5,  # a boolean as 0 or 1
        "game.legal": 0.5,  # over the events that recorded a number
        "game.rounds": 4.0,
        "turn.rounds": 9.0,  # another event's field of the same name
    }  # no text, list, mapping, None or NaN
    assert event_metrics([]) == {}


def span(rid: str, aid: str, name: str, at: float, end: float | None = None, **attrs) -> Span:
    return Span(
        rollout_id=rid,
        attempt_id=aid,
        name=name,
        start_time=at,
        end_time=at if end is None else end,
        attributes=attrs,
    )


def test_only_the_final_attempt_of_a_succeeded_rollout_counts(tmp_path: Path) -> None:
    async def finish(store: SQLStore, status: str, *events: tuple) -> str:
        claim = await store.claim("w")
        assert claim is not None
        rid, aid = claim.rollout.rollout_id, claim.attempt.attempt_id
        spans = [span(rid, aid, *e[:-1], **e[-1]) for e in events]
        done = status == "succeeded"
        result = AttemptResult(
            status=status, reward=1.0 if done else None, error=None if done else "boom", spans=spans
        )
        await store.complete(aid, result)
        return rid

    async def scenario() -> list[Event]:
        store = SQLStore(tmp_path / "store.sqlite")
        try:
            await store.enqueue([Task(input={"i": 0})], max_attempts=2)
            retried = await finish(store, "failed", ("ep", 1.0, {"ok": 0}))  # tried again
            again = await finish(
                store,
                "succeeded",
                ("ep", 3.0, {"ok": 1}),
                ("tool", 1.0, 2.0, {"ok": 5}),  # a timed span, not an event
                ("start", 0.5, {"ok": 7}),
            )
            assert again == retried
            await store.enqueue([Task(input={"i": 1})], max_attempts=1)
            await finish(store, "failed", ("ep", 1.0, {"ok": 9}))  # failed for good
            rollouts = await store.query_rollouts()
            assert sorted(r.status for r in rollouts) == ["failed", "succeeded"]
            return await rollout_events(store, rollouts)
        finally:
            await store.close()

    found = asyncio.run(scenario())
    assert [(e.name, e.attributes) for e in found] == [("start", {"ok": 7}), ("ep", {"ok": 1})]
    assert [e.name for e in events([span("r", "a", "x", 2.0), span("r", "a", "y", 1.0)])] == [
        "y",
        "x",
    ]  # in the order recorded


@vl.rollout
async def reporting_agent(task: dict, llm: vl.LLM) -> float:
    """One call; says how it went in an ``episode`` event, as tau2's agent does."""
    reply = await llm.openai_client().chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": f"Say {task['letter']}."}],
        **llm.sampling_parameters,
    )
    text = reply.choices[0].message.content or ""
    found = task["letter"] in text
    vl.emit_event(
        "episode",
        found=found,
        length=len(text),
        termination="said" if found else "missed",
        transcript=[text],  # a list: left out
    )
    return float(found)


def test_localrl_logs_the_events_of_each_step_and_validation_and_names_their_versions(
    tmp_path: Path,
) -> None:
    algo = make_algorithm(validation={"every": 1}, checkpoints={"every": 0})
    trainer = vl.Trainer(algo, n_runners=1, inline=True, run_dir=tmp_path, name="ev")
    result = trainer.fit(reporting_agent, ROWS, val_dataset=ROWS[:2])
    steps = [m for m in result.metrics if "batch/rows" in m]
    vals = [m for m in result.metrics if "val/reward_mean" in m]
    assert len(steps) == 2 and len(vals) == 3
    for mode, records in (("train", steps), ("val", vals)):
        for m in records:
            mine = {k for k in m if k.startswith(f"{mode}/events/")}
            assert {f"{mode}/events/episode.found", f"{mode}/events/episode.length"} <= mine
            assert not any("transcript" in k for k in mine)
            # the found share is the reward's mean: the agent returns it
            assert m[f"{mode}/events/episode.found"] == m[f"{mode}/reward_mean"]
            assert not any("termination" in k for k in mine)  # a text
    assert version_labels(tmp_path, result.run.run_id) == [
        "validation before training",
        "step 1",
        "validation after step 1",
        "step 2",
        "validation after step 2",
    ]
