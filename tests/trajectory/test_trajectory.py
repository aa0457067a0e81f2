"""The trajectory builder: merging, credit assignment, AIR, selection, caps, batches, store."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from voltrl.errors import MissingTokenIdsError
from voltrl.store.memory import InMemoryStore
from voltrl.trajectory import (
    TrajectoryConfig,
    build_trajectory,
    collate,
    default_tool_error,
    trajectories_from_store,
)
from voltrl.trajectory.rows import cap_indices
from voltrl.types import AttemptResult, LLMCall, Reward, Rollout, Span, Task, Trajectory, Transition

RID, AID = "ro-1", "at-1"


def rollout(status: str = "succeeded", reward: float | None = 1.0, task_id: str = "t1") -> Rollout:
    return Rollout(
        rollout_id=RID,
        task=Task(task_id=task_id, input={}),
        status=status,  # type: ignore[arg-type]
        reward=reward,
        final_attempt_id=AID if status == "succeeded" else None,
    )


def call(
    seq: int,
    prompt: list[int] | None,
    response: list[int] | None,
    logprobs: list[float] | None = None,
    *,
    agent: str | None = None,
    end: float | None = None,
    messages: list[dict[str, Any]] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    attempt_id: str = AID,
) -> LLMCall:
    message: dict[str, Any] = {"role": "assistant", "content": "ok"}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    t = float(end if end is not None else 10 * (seq + 1))
    return LLMCall(
        rollout_id=RID,
        attempt_id=attempt_id,
        sequence_id=seq,
        agent_name=agent,
        prompt_token_ids=prompt,
        response_token_ids=response,
        response_logprobs=logprobs,
        request={"messages": messages or []},
        response={"choices": [{"index": 0, "message": message}]},
        started_at=t - 1,
        ended_at=t,
    )


def reward(value: float, at: float, source: str = "emit") -> Reward:
    return Reward(rollout_id=RID, attempt_id=AID, value=value, timestamp=at, source=source)  # type: ignore[arg-type]


def chain(n: int, **kw: Any) -> list[LLMCall]:
    """``n`` calls that each extend the previous prompt + response with one context token."""
    calls, prompt = [], [1, 2]
    for i in range(n):
        response = [100 + i, 200 + i]
        calls.append(call(i, prompt, response, [-0.1 * (i + 1), -0.2 * (i + 1)], **kw))
        prompt = [*prompt, *response, 50 + i]
    return calls


def rewards_of(traj: Trajectory) -> list[float | None]:
    return [t.reward for t in traj.transitions]


# ---- merging ---------------------------------------------------------------------------------

turn_spec = st.tuples(
    st.lists(st.integers(0, 999), min_size=1, max_size=6),  # generated tokens
    st.lists(st.integers(0, 999), max_size=4),  # context fed in before them
    st.booleans(),  # start afresh (a prompt that does not extend)
)


@settings(max_examples=200, deadline=None)
@given(st.lists(turn_spec, min_size=1, max_size=8))
def test_trajectory_merging_keeps_every_generated_token_once_in_order_with_aligned_logprobs(
    spec: list[tuple[list[int], list[int], bool]],
) -> None:
    calls, generated, generated_lp, breaks, full = [], [], [], 0, []
    for i, (response, context, fresh) in enumerate(spec):
        if i == 0 or fresh:
            breaks += i > 0
            prompt = [10_000 + i, *context]  # a unique first token: never extends another row
        else:
            prompt = [*full, *context]
        logprobs = [-(len(generated_lp) + k + 1) / 1000 for k in range(len(response))]
        calls.append(call(i, prompt, response, logprobs))
        generated += response
        generated_lp += logprobs
        full = [*prompt, *response]

    traj = build_trajectory(rollout(), calls, config=TrajectoryConfig(mode="trajectory"))

    rows = traj.transitions
    assert traj.merge_failures == breaks and len(rows) == breaks + 1
    kept, kept_lp = [], []
    for row in rows:
        mask, lp = row.response_mask or [], row.response_logprobs or []
        assert len(mask) == len(lp) == len(row.response_token_ids)
        kept += [tok for tok, m in zip(row.response_token_ids, mask, strict=True) if m == 1]
        kept_lp += [x for x, m in zip(lp, mask, strict=True) if m == 1]
        assert all(x == 0.0 for x, m in zip(lp, mask, strict=True) if m == 0)
        last = calls[row.metadata["turns"][-1]]
        assert row.prompt_token_ids + row.response_token_ids == (
            (last.prompt_token_ids or []) + (last.response_token_ids or [])
        )
    assert kept == generated
    assert kept_lp == generated_lp


def test_trajectory_mode_puts_tool_results_in_the_response_with_mask_zero() -> None:
    traj = build_trajectory(rollout(), chain(2), config=TrajectoryConfig(mode="trajectory"))
    (row,) = traj.transitions
    assert row.prompt_token_ids == [1, 2]
    assert row.response_token_ids == [100, 200, 50, 101, 201]
    assert row.response_mask == [1, 1, 0, 1, 1]
    assert row.response_logprobs == [-0.1, -0.2, 0.0, -0.2, -0.4]
    assert row.metadata["turns"] == [0, 1] and traj.merge_failures == 0


def test_a_call_that_does_not_extend_the_sequence_starts_a_new_row_and_counts_a_failure() -> None:
    calls = chain(3)
    calls[1] = call(1, [9, 9, 9], [7], [-1.0])  # history rewritten (e.g. summarised)
    traj = build_trajectory(rollout(), calls, config=TrajectoryConfig(mode="trajectory"))
    # call 2 extends neither call 1's sequence: it was built from the original history
    assert traj.merge_failures == 2
    assert [r.metadata["turns"] for r in traj.transitions] == [[0], [1], [2]]
    assert traj.stats["merge_failures"] == 2
    assert collate([traj]).stats["merge_failures"] == 2


def test_trajectory_mode_merges_each_agent_with_its_own_previous_call() -> None:
    a0, b0 = call(0, [1], [2], agent="a"), call(1, [5], [6], agent="b")
    a1, b1 = call(2, [1, 2, 3], [4], agent="a"), call(3, [5, 6, 7], [8], agent="b")
    traj = build_trajectory(rollout(), [a0, b0, a1, b1], config=TrajectoryConfig(mode="trajectory"))
    assert traj.merge_failures == 0
    assert [(r.agent_name, r.response_token_ids) for r in traj.transitions] == [
        ("a", [2, 3, 4]),
        ("b", [6, 7, 8]),
    ]


def test_a_row_records_its_model_and_merges_only_calls_sampled_by_that_model() -> None:
    """Per-role LoRA adapters: a row trains the adapter that sampled it, so calls of one agent
    sampled by two adapters (say, before and after the patterns changed) are not merged."""
    a0, a1 = call(0, [1], [2], agent="a"), call(1, [1, 2, 3], [4], agent="a")
    a0.model, a1.model = "writer", "writer"
    a2 = call(2, [1, 2, 3, 4, 5], [6], agent="a")
    a2.model = "checker"
    traj = build_trajectory(rollout(), [a0, a1, a2], config=TrajectoryConfig(mode="trajectory"))
    assert [(r.model, r.response_token_ids) for r in traj.transitions] == [
        ("writer", [2, 3, 4]),
        ("checker", [6]),
    ]
    assert traj.merge_failures == 0  # another policy's row, not a prompt that failed to extend
    batch = collate([traj])
    assert batch.models == ["writer", "checker"]
    picked = batch.select([1])
    assert picked.models == ["checker"] and picked.response_ids == [batch.response_ids[1]]
    assert (picked.prompt_length, picked.response_length) == (batch.prompt_length, 3)
    assert len(picked) == 1 and picked.stats == batch.stats


def test_transition_mode_makes_one_row_per_call_with_every_token_generated() -> None:
    calls = chain(3)
    traj = build_trajectory(rollout(), calls)
    assert [r.response_mask for r in traj.transitions] == [[1, 1]] * 3
    assert [r.metadata["call_ids"] for r in traj.transitions] == [[c.call_id] for c in calls]
    assert traj.merge_failures == 0


def test_calls_are_ordered_by_sequence_id_and_other_attempts_are_ignored() -> None:
    calls = chain(2)
    stray = call(5, [0], [0], attempt_id="at-old")
    traj = build_trajectory(rollout(), [calls[1], stray, calls[0]])
    assert [r.metadata["turns"] for r in traj.transitions] == [[0], [1]]
    assert traj.transitions[0].response_token_ids == [100, 200]


# ---- credit assignment ------------------------------------------------------------------------


def test_final_credit_gives_the_final_reward_to_every_turn() -> None:
    traj = build_trajectory(rollout(reward=2.0), chain(3))
    assert rewards_of(traj) == [2.0, 2.0, 2.0] and traj.reward == 2.0


def test_discounted_credit_gives_turn_t_gamma_to_the_remaining_turns_times_the_reward() -> None:
    config = TrajectoryConfig(credit="discounted", gamma=0.5)
    traj = build_trajectory(rollout(reward=2.0), chain(3), config=config)
    assert rewards_of(traj) == [0.5, 1.0, 2.0]


def test_a_merged_row_gets_the_credit_of_its_first_turn() -> None:
    config = TrajectoryConfig(credit="discounted", gamma=0.5, mode="trajectory")
    traj = build_trajectory(rollout(reward=2.0), chain(3), config=config)
    assert rewards_of(traj) == [0.5]


def test_per_step_rewards_belong_to_the_last_call_ended_before_them_and_are_discounted() -> None:
    calls = chain(3)  # calls end at t=10, 20, 30
    records = [
        reward(1.0, at=5),  # before any call: the first call's
        reward(2.0, at=10),  # exactly at call 0's end: call 0's
        reward(4.0, at=25),  # call 1's
        reward(8.0, at=35),  # call 2's
        reward(100.0, at=36, source="return"),  # the final reward, never a step reward
    ]
    config = TrajectoryConfig(credit="per_step", gamma=0.5)
    traj = build_trajectory(rollout(reward=10.0), calls, records, config=config)
    # G2 = 8; G1 = 4 + 0.5 * 8 = 8; G0 = (1 + 2) + 0.5 * 8 = 7
    assert rewards_of(traj) == [7.0, 8.0, 8.0]

    with_final = config.model_copy(update={"per_step_add_final": True})
    traj = build_trajectory(rollout(reward=10.0), calls, records, config=with_final)
    assert rewards_of(traj) == [17.0, 18.0, 18.0]


# ---- automatic intermediate rewards ------------------------------------------------------------


def tool_msg(call_id: str | None, content: str) -> dict[str, Any]:
    msg = {"role": "tool", "content": content}
    return {**msg, "tool_call_id": call_id} if call_id else msg


def tool_call(call_id: str | None) -> dict[str, Any]:
    tc = {"type": "function", "function": {"name": "calc", "arguments": "{}"}}
    return {**tc, "id": call_id} if call_id else tc


AIR = TrajectoryConfig(air=True, air_success_reward=0.1, air_failure_reward=-0.5)


def tool_calls_rollout() -> list[LLMCall]:
    """Call 0 runs tools c1 (ok) and c2 (fails); call 1 runs c3 (fails, JSON error)."""
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    return [
        call(0, [1], [2], tool_calls=[tool_call("c1"), tool_call("c2")]),
        call(
            1,
            [3],
            [4],
            tool_calls=[tool_call("c3")],
            messages=[*history, tool_msg("c1", "42"), tool_msg("c2", "Error: division by zero")],
        ),
        call(2, [5], [6], messages=[*history, tool_msg("c3", json.dumps({"error": "bad"}))]),
    ]


def test_air_rewards_each_tool_call_by_its_result_in_the_next_request() -> None:
    traj = build_trajectory(rollout(reward=1.0), tool_calls_rollout(), config=AIR)
    assert rewards_of(traj) == pytest.approx([1.0 + 0.1 - 0.5, 1.0 - 0.5, 1.0])


def test_air_without_tool_call_ids_reads_the_tool_messages_after_the_last_assistant_turn() -> None:
    calls = [
        call(0, [1], [2], tool_calls=[tool_call(None)]),
        call(
            1,
            [3],
            [4],
            messages=[
                tool_msg(None, "Error: old failure, before the last assistant message"),
                {"role": "assistant", "content": ""},
                tool_msg(None, "Traceback (most recent call last):\n  ...\nValueError"),
            ],
        ),
    ]
    traj = build_trajectory(rollout(reward=0.0), calls, config=AIR)
    assert rewards_of(traj) == [-0.5, 0.0]


def test_air_error_spans_fail_the_tool_call_they_name_or_else_the_call_that_issued_them() -> None:
    spans = [
        Span(rollout_id=RID, attempt_id=AID, name="tool c1", status="error",
             attributes={"gen_ai.tool.call.id": "c1"}, start_time=12),
        Span(rollout_id=RID, attempt_id=AID, name="tool", status="error",
             attributes={"tool.name": "search"}, start_time=31),
        Span(rollout_id=RID, attempt_id=AID, name="not a tool", status="error", start_time=31),
    ]  # fmt: skip
    traj = build_trajectory(rollout(reward=1.0), tool_calls_rollout(), spans=spans, config=AIR)
    # call 0: c1 now failed too; call 2: no tool result, the id-less error span adds a failure
    assert rewards_of(traj) == pytest.approx([0.0, 0.5, 0.5])


def test_air_uses_the_configured_error_predicate() -> None:
    config = AIR.model_copy(update={"air_is_error": lambda text: text == "42"})
    traj = build_trajectory(rollout(reward=1.0), tool_calls_rollout(), config=config)
    assert rewards_of(traj) == pytest.approx([1.0 - 0.5 + 0.1, 1.1, 1.0])


def test_air_rewards_propagate_through_per_step_returns() -> None:
    config = AIR.model_copy(update={"credit": "per_step", "gamma": 1.0})
    traj = build_trajectory(rollout(reward=1.0), tool_calls_rollout(), config=config)
    assert rewards_of(traj) == pytest.approx([-0.9, -0.5, 0.0])


@pytest.mark.parametrize(
    ("content", "failed"),
    [
        ("Error: no such file", True),
        ("Traceback (most recent call last):\n  File ...", True),
        ('{"error": "timeout"}', True),
        ('{"error": null, "result": 3}', False),
        ('{"result": 3}', False),
        ("42", False),
        ("the Error was fixed", False),
    ],
)
def test_default_tool_error_predicate(content: str, failed: bool) -> None:
    assert default_tool_error(content) is failed


# ---- selection --------------------------------------------------------------------------------


def test_agent_filter_trains_only_matching_agents_but_keeps_their_positions_and_air() -> None:
    calls = [
        call(0, [1], [2], agent="planner"),
        call(1, [3], [4], agent="coder", tool_calls=[tool_call("c1")]),
        call(2, [5], [6], agent="planner", messages=[tool_msg("c1", "Error: failed")]),
    ]
    config = AIR.model_copy(update={"agent_filter": "coder", "credit": "discounted", "gamma": 0.5})
    traj = build_trajectory(rollout(reward=1.0), calls, config=config)
    (row,) = traj.transitions
    assert row.agent_name == "coder" and row.metadata["turns"] == [1]
    assert row.reward == pytest.approx(0.5 - 0.5)  # turn 1 of 3, plus the tool failure
    assert traj.stats["dropped/agent_filter"] == 2


def test_rewards_addressed_to_agents_are_their_calls_final_reward() -> None:
    """A game: each team's calls get the team's outcome (``emit_reward(v, agents=...)``),
    the last such reward wins, other agents keep the rollout's reward, and addressed rewards
    are never step rewards."""

    def addressed(value: float, agents: str, at: float) -> Reward:
        return Reward(
            rollout_id=RID, attempt_id=AID, value=value, timestamp=at, metadata={"agents": agents}
        )

    calls = [
        call(0, [1], [2], agent="wolves/p1"),
        call(1, [3], [4], agent="village/p2"),
        call(2, [5], [6], agent="wolves/p3"),
        call(3, [7], [8], agent="judge"),
    ]
    rewards = [
        addressed(0.5, "wolves/.*", 31),
        addressed(1.0, "wolves/.*", 41),
        addressed(-1.0, "village/.*", 41),
        reward(0.25, 15),  # a step reward of turn 0
    ]
    finals = build_trajectory(rollout(reward=0.0), calls, rewards)
    assert [t.reward for t in finals.transitions] == [1.0, -1.0, 1.0, 0.0]
    config = TrajectoryConfig(credit="per_step", per_step_add_final=True)
    steps = build_trajectory(rollout(reward=0.0), calls, rewards, config=config)
    assert [t.reward for t in steps.transitions] == [1.25, -1.0, 1.0, 0.0]
    # without a returned reward, the rollout's final is the last reward not addressed
    fallback = build_trajectory(rollout(reward=None), calls, rewards)
    assert fallback.transitions[3].reward == 0.25


def addressed(value: float, agents: str, at: float = 100.0) -> Reward:
    """A reward emitted with ``agents=``: the final reward of those agents' calls."""
    return Reward(
        rollout_id=RID, attempt_id=AID, value=value, timestamp=at, metadata={"agents": agents}
    )


def test_a_rollout_rewarded_only_per_agent_trains_the_calls_the_rewards_address(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing returned, only ``emit_reward(v, agents=...)``: each team's calls train on the
    team's reward; a call no reward addresses is left out, counted, and warned about once."""
    calls = [
        call(0, [1], [2], agent="red/p1"),
        call(1, [3], [4], agent="blue/p2"),
        call(2, [5], [6], agent="unit-referee"),
        call(3, [7], [8], agent="red/p3"),
    ]
    rewards = [addressed(1.0, "red/.*"), addressed(0.0, "blue/.*")]
    with caplog.at_level("WARNING", logger="voltrl.trajectory"):
        traj = build_trajectory(rollout(reward=None), calls, rewards)
        again = build_trajectory(rollout(reward=None), calls, rewards)
    rows = [(t.agent_name, t.reward, t.metadata["turns"]) for t in traj.transitions]
    assert rows == [("red/p1", 1.0, [0]), ("blue/p2", 0.0, [1]), ("red/p3", 1.0, [3])]
    dropped = {k: v for k, v in traj.stats.items() if k.startswith("dropped/")}
    assert traj.reward is None and dropped == {"dropped/no_agent_reward": 1}
    assert again.stats == traj.stats
    warnings = [r.getMessage() for r in caplog.records if r.name == "voltrl.trajectory"]
    assert len(warnings) == 1 and "['unit-referee']" in warnings[0]  # once per agent name
    assert "dropped/no_agent_reward" in warnings[0]
    batch = collate([traj])
    assert batch.rewards == [1.0, 0.0, 1.0] and batch.agent_names == ["red/p1", "blue/p2", "red/p3"]
    assert batch.stats["dropped/no_agent_reward"] == 1 and "dropped/no_reward" not in batch.stats
    # the left-out call still counts as a turn: red/p1 is 3 turns from the end
    config = TrajectoryConfig(credit="discounted", gamma=0.5)
    discounted = build_trajectory(rollout(reward=None), calls, rewards, config=config)
    assert [t.reward for t in discounted.transitions] == [0.125, 0.0, 1.0]
    # explicit transitions without a reward of their own get their agent's, the same way
    transitions = [
        Transition(prompt_token_ids=[1], response_token_ids=[2], agent_name="red/p1"),
        Transition(prompt_token_ids=[3], response_token_ids=[4], agent_name="unit-referee"),
        Transition(prompt_token_ids=[5], response_token_ids=[6], agent_name="blue/p2", reward=0.5),
    ]
    explicit = build_trajectory(rollout(reward=None), [], rewards, transitions=transitions)
    assert [(t.agent_name, t.reward) for t in explicit.transitions] == [
        ("red/p1", 1.0),
        ("blue/p2", 0.5),
    ]
    assert explicit.stats["dropped/no_agent_reward"] == 1
    # with no reward at all, or none addressing any call, nothing trains
    none = build_trajectory(rollout(reward=None), calls, [])
    assert none.transitions == [] and none.stats == {"dropped/no_reward": 1}
    unmatched = build_trajectory(rollout(reward=None), calls, [addressed(1.0, "green/.*")])
    assert unmatched.transitions == []
    assert unmatched.stats == {"dropped/no_agent_reward": 4, "dropped/no_trainable_calls": 1}


def test_agent_filter_must_match_the_whole_name() -> None:
    config = TrajectoryConfig(agent_filter="code")
    assert not config.trains_agent("coder") and config.trains_agent("code")
    assert not config.trains_agent(None)
    with pytest.raises(ValidationError, match="agent_filter"):
        TrajectoryConfig(agent_filter="(")


def test_transition_cap_keeps_evenly_spaced_rows_including_first_and_last() -> None:
    assert cap_indices(10, 4) == [0, 3, 6, 9]
    assert cap_indices(10, 1) == [9]
    assert cap_indices(5, 2) == [0, 4]
    assert cap_indices(3, 5) == [0, 1, 2]
    config = TrajectoryConfig(max_transitions_per_rollout=3)
    traj = build_trajectory(rollout(), chain(5), config=config)
    assert [r.metadata["turns"] for r in traj.transitions] == [[0], [2], [4]]
    assert traj.stats["dropped/over_cap"] == 2


def test_truncate_keeps_the_prompt_end_and_the_response_start_with_matching_mask() -> None:
    config = TrajectoryConfig(mode="trajectory", max_prompt_length=1, max_response_length=3)
    traj = build_trajectory(rollout(), chain(2), config=config)
    (row,) = traj.transitions
    assert row.prompt_token_ids == [2]
    assert row.response_token_ids == [100, 200, 50]
    assert row.response_mask == [1, 1, 0]
    assert row.response_logprobs == [-0.1, -0.2, 0.0]
    assert row.metadata["truncated_prompt"] and row.metadata["truncated_response"]
    assert traj.stats["truncated/prompt"] == 1 and traj.stats["truncated/response"] == 1


def test_drop_length_policy_drops_and_counts_rows_that_are_too_long() -> None:
    calls = [call(0, [1], [2]), call(1, [1, 2, 3], [4]), call(2, [1], [2, 3, 4])]
    config = TrajectoryConfig(length_policy="drop", max_prompt_length=2, max_response_length=2)
    traj = build_trajectory(rollout(), calls, config=config)
    assert [r.metadata["turns"] for r in traj.transitions] == [[0]]
    assert traj.stats["dropped/too_long"] == 2


def test_rows_without_generated_tokens_are_dropped_and_counted() -> None:
    traj = build_trajectory(rollout(), [call(0, [1], []), call(1, [1], [2])])
    assert len(traj.transitions) == 1 and traj.stats["dropped/empty_response"] == 1


def test_failed_rollouts_are_dropped_by_default() -> None:
    traj = build_trajectory(rollout(status="failed", reward=None), chain(2))
    assert traj.transitions == [] and traj.stats == {"dropped/failed": 1}
    batch = collate([traj])
    assert len(batch) == 0 and batch.stats["dropped/failed"] == 1


def test_failed_rollouts_train_with_the_fill_reward_when_asked() -> None:
    config = TrajectoryConfig(failed_rollouts="fill", fill_reward=-1.0)
    traj = build_trajectory(rollout(status="failed", reward=None), chain(2), config=config)
    assert rewards_of(traj) == [-1.0, -1.0] and traj.reward == -1.0


@pytest.mark.parametrize(
    ("status", "reason"),
    [("cancelled", "cancelled"), ("running", "unfinished"), ("succeeded", "no_reward")],
)
def test_rollouts_that_cannot_train_are_dropped_with_their_reason(status: str, reason: str) -> None:
    config = TrajectoryConfig(failed_rollouts="fill")
    traj = build_trajectory(rollout(status=status, reward=None), chain(1), config=config)
    assert traj.transitions == [] and traj.stats == {f"dropped/{reason}": 1}


def test_a_succeeded_rollout_without_rollout_reward_uses_its_last_reward_record() -> None:
    traj = build_trajectory(rollout(reward=None), chain(1), [reward(0.3, at=1), reward(0.7, at=2)])
    assert rewards_of(traj) == [0.7]


# ---- calls without token ids -------------------------------------------------------------------


def test_calls_without_token_ids_are_dropped_and_counted_by_default() -> None:
    calls = chain(3)
    calls[1] = calls[1].model_copy(update={"prompt_token_ids": None, "response_token_ids": None})
    traj = build_trajectory(rollout(), calls)
    assert [r.metadata["turns"] for r in traj.transitions] == [[0], [2]]
    assert traj.stats["dropped/missing_token_ids"] == 1
    assert collate([traj]).stats["dropped/missing_token_ids"] == 1


def test_in_trajectory_mode_a_dropped_calls_tokens_become_context() -> None:
    calls = chain(3)
    calls[1] = calls[1].model_copy(update={"prompt_token_ids": None, "response_token_ids": None})
    traj = build_trajectory(rollout(), calls, config=TrajectoryConfig(mode="trajectory"))
    (row,) = traj.transitions
    assert row.response_token_ids == [100, 200, 50, 101, 201, 51, 102, 202]
    assert row.response_mask == [1, 1, 0, 0, 0, 0, 1, 1]


def test_missing_token_ids_error_policy_raises_a_typed_error() -> None:
    calls = [call(0, None, None)]
    with pytest.raises(MissingTokenIdsError, match=calls[0].call_id):
        build_trajectory(rollout(), calls, config=TrajectoryConfig(missing_token_ids="error"))


def test_retokenize_policy_uses_the_given_callable_and_counts_it() -> None:
    config = TrajectoryConfig(
        missing_token_ids="retokenize", retokenizer=lambda c: ([7, 7], [8, len(c.call_id)])
    )
    c = call(0, None, None)
    traj = build_trajectory(rollout(), [c], config=config)
    (row,) = traj.transitions
    assert row.prompt_token_ids == [7, 7] and row.response_token_ids == [8, len(c.call_id)]
    assert row.response_logprobs == [0.0, 0.0]
    assert traj.stats["retokenized"] == 1 and traj.stats["missing_logprobs"] == 1
    with pytest.raises(ValidationError, match="retokenizer"):
        TrajectoryConfig(missing_token_ids="retokenize")


def test_missing_or_misaligned_logprobs_become_zero_and_are_counted() -> None:
    calls = [call(0, [1], [2, 3], None), call(1, [1], [2, 3], [-1.0])]
    traj = build_trajectory(rollout(), calls)
    assert [r.response_logprobs for r in traj.transitions] == [[0.0, 0.0], [0.0, 0.0]]
    assert traj.stats["missing_logprobs"] == 2


# ---- explicit transitions ---------------------------------------------------------------------


def test_explicit_transitions_are_used_as_is_instead_of_calls() -> None:
    given_rows = [
        Transition(prompt_token_ids=[1], response_token_ids=[2, 3], response_mask=[1, 0],
                   response_logprobs=[-0.5, 0.0], reward=0.25, agent_name="a", metadata={"k": 1}),
        Transition(prompt_token_ids=[4], response_token_ids=[5], agent_name="a"),
        Transition(prompt_token_ids=[6], response_token_ids=[7], agent_name="b"),
    ]  # fmt: skip
    config = TrajectoryConfig(credit="discounted", gamma=0.5, agent_filter="a", mode="trajectory")
    traj = build_trajectory(rollout(reward=4.0), chain(5), config=config, transitions=given_rows)
    first, second = traj.transitions
    assert (first.prompt_token_ids, first.response_token_ids) == ([1], [2, 3])
    assert first.response_mask == [1, 0] and first.response_logprobs == [-0.5, 0.0]
    assert first.reward == 0.25 and first.metadata["k"] == 1
    assert second.reward == 2.0  # no reward given: turn 1 of 3, discounted
    assert second.response_mask == [1] and second.response_logprobs == [0.0]
    assert traj.stats["dropped/agent_filter"] == 1


# ---- collation --------------------------------------------------------------------------------


def test_group_by_agent_gives_each_side_of_a_task_its_own_grpo_group() -> None:
    """Wolves won both games of a deal: grouped by task, the wolves' calls get a positive
    advantage and the village's a negative one from the same outcome twice over; grouped by
    side, nothing differs within a group, so nothing is learned from it."""
    import torch

    from voltrl.algorithms.local.loss import grpo_advantages

    def game(rollout_id: str) -> Trajectory:
        return Trajectory(rollout_id=rollout_id, task_id="deal", transitions=[
            Transition(prompt_token_ids=[1], response_token_ids=[2], reward=1.0,
                       agent_name="policy/wolves/werewolf/Player1"),
            Transition(prompt_token_ids=[1], response_token_ids=[2], reward=0.0,
                       agent_name="policy/village/seer/Player2"),
            Transition(prompt_token_ids=[1], response_token_ids=[2], reward=0.5,
                       agent_name="moderator"),
        ])  # fmt: skip

    games = [game("r1"), game("r2")]
    by_task = collate(games, TrajectoryConfig())
    by_side = collate(games, TrajectoryConfig(group_by_agent=r"[^/]+/([^/]+)/.*"))
    assert by_task.group_ids == ["deal"] * 6 and by_task.stats["groups"] == 1
    assert by_side.group_ids == ["deal/wolves", "deal/village", "deal"] * 2  # no match: task
    assert by_side.stats["groups"] == 3
    assert grpo_advantages(torch.tensor(by_task.rewards), by_task.group_ids).abs().sum() > 1
    assert grpo_advantages(torch.tensor(by_side.rewards), by_side.group_ids).abs().sum() == 0
    with pytest.raises(ValidationError, match="has no capturing group"):
        TrajectoryConfig(group_by_agent="policy/.*")
    with pytest.raises(ValidationError, match="group_by_agent is not a valid regex"):
        TrajectoryConfig(group_by_agent="(")


def test_collate_left_pads_prompts_right_pads_responses_and_places_rewards() -> None:
    t1 = Trajectory(rollout_id="r1", task_id="g1", reward=1.0, transitions=[
        Transition(prompt_token_ids=[11, 12], response_token_ids=[13, 14, 15],
                   response_mask=[1, 1, 0], response_logprobs=[-1.0, -2.0, 0.0], reward=1.0),
    ], stats={"merge_failures": 1, "dropped/too_long": 2})  # fmt: skip
    t2 = Trajectory(rollout_id="r2", task_id="g1", reward=0.5, transitions=[
        Transition(prompt_token_ids=[21, 22, 23], response_token_ids=[24]),
    ], stats={"dropped/too_long": 1})  # fmt: skip
    batch = collate([t1, t2], TrajectoryConfig(pad_token_id=-1))

    assert batch.prompt_ids == [[-1, 11, 12], [21, 22, 23]]
    assert batch.prompt_mask == [[0, 1, 1], [1, 1, 1]]
    assert batch.response_ids == [[13, 14, 15], [24, -1, -1]]
    assert batch.response_mask == [[1, 1, 0], [1, 0, 0]]
    assert batch.response_logprobs == [[-1.0, -2.0, 0.0], [0.0, 0.0, 0.0]]
    assert batch.attention_mask == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert batch.position_ids == [[0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 3, 3]]
    assert batch.rewards == [1.0, 0.5]  # the second transition has none: its rollout's
    assert batch.token_level_rewards == [[0.0, 1.0, 0.0], [0.5, 0.0, 0.0]]
    assert batch.group_ids == ["g1", "g1"] and batch.rollout_ids == ["r1", "r2"]
    assert (batch.prompt_length, batch.response_length, batch.pad_token_id) == (3, 3, -1)
    assert batch.stats == {
        "merge_failures": 1,
        "dropped/too_long": 3,
        "rows": 2,
        "groups": 1,
        "rollouts": 2,
        "rollouts_with_rows": 2,
    }


def test_collate_pads_to_the_configured_maximum_lengths_when_asked() -> None:
    traj = build_trajectory(rollout(), chain(1))
    config = TrajectoryConfig(pad_to_max_lengths=True, max_prompt_length=4, max_response_length=5)
    batch = collate([traj], config)
    assert batch.prompt_ids == [[0, 0, 1, 2]]
    assert batch.response_ids == [[100, 200, 0, 0, 0]]
    assert len(batch.position_ids[0]) == 9


def test_collate_of_nothing_is_an_empty_batch() -> None:
    batch = collate([])
    assert len(batch) == 0 and batch.prompt_ids == [] and batch.stats["rows"] == 0


def test_collate_rejects_a_transition_without_any_reward() -> None:
    traj = Trajectory(rollout_id="r", task_id="g", transitions=[
        Transition(prompt_token_ids=[1], response_token_ids=[2]),
    ])  # fmt: skip
    with pytest.raises(ValueError, match="no reward"):
        collate([traj])


def test_to_torch_converts_the_batch_to_tensors() -> None:
    import torch

    batch = collate([build_trajectory(rollout(), chain(2), config=TrajectoryConfig())])
    tensors = batch.to_torch()
    width = batch.prompt_length + batch.response_length
    assert tensors["input_ids"].shape == (2, width) and tensors["input_ids"].dtype == torch.long
    assert tensors["input_ids"].tolist() == [
        p + r for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)
    ]
    assert tensors["token_level_rewards"].sum().item() == pytest.approx(2.0)
    assert collate([]).to_torch()["prompt_ids"].shape == (0, 0)


# ---- store round trip -------------------------------------------------------------------------


async def test_trajectories_from_store_build_the_winning_attempt_of_each_rollout() -> None:
    store = InMemoryStore()
    (ro,) = await store.enqueue([Task(task_id="grp", input={"q": "1+1"})])

    async def run_attempt(status: str, response: int, rewards: list[float]) -> str:
        claim = await store.claim("w1")
        assert claim is not None
        aid = claim.attempt.attempt_id
        await store.add_llm_calls([
            LLMCall(rollout_id=ro.rollout_id, attempt_id=aid, agent_name="solver",
                    prompt_token_ids=[1, 2], response_token_ids=[response],
                    response_logprobs=[-0.5], ended_at=0.0),
            LLMCall(rollout_id=ro.rollout_id, attempt_id=aid, agent_name="solver",
                    prompt_token_ids=[1, 2, response, 3], response_token_ids=[response + 1],
                    response_logprobs=[-0.25], ended_at=0.0),
        ])  # fmt: skip
        emitted = [Reward(rollout_id=ro.rollout_id, attempt_id=aid, value=v) for v in rewards]
        await store.complete(aid, AttemptResult(status=status, rewards=emitted))  # type: ignore[arg-type]
        return aid

    await run_attempt("failed", 66, [])  # retried: its calls must not be trained on
    winner = await run_attempt("succeeded", 7, [0.2, 0.9])

    config = TrajectoryConfig(mode="trajectory")
    (traj,) = await trajectories_from_store(store, [ro.rollout_id], config)
    batch = collate([traj], config)
    assert traj.reward == 0.9 and traj.task_id == "grp"
    assert batch.response_ids == [[7, 3, 8]] and batch.response_mask == [[1, 0, 1]]
    assert batch.response_logprobs == [[-0.5, 0.0, -0.25]]
    assert batch.rewards == [0.9] and batch.group_ids == ["grp"]
    calls = await store.get_llm_calls(ro.rollout_id, winner)
    assert traj.transitions[0].metadata["call_ids"] == [c.call_id for c in calls]


def test_selected_calls_and_those_cut_off_are_counted() -> None:
    """``calls`` counts the calls selected for training, ``stopped/length`` those of them whose
    reply was cut off (``finish_reason`` ``"length"``); a call the agent filter left out counts
    in neither."""
    a, b, c = (call(i, [1, 2, 3 + i], [9], agent=name) for i, name in enumerate("aab"))
    a = a.model_copy(update={"finish_reason": "length"})
    c = c.model_copy(update={"finish_reason": "length"})
    traj = build_trajectory(rollout(), [a, b, c], config=TrajectoryConfig(agent_filter="a"))
    assert traj.stats["calls"] == 2 and traj.stats["stopped/length"] == 1
    assert traj.stats["dropped/agent_filter"] == 1


async def test_trajectories_from_store_use_explicit_transitions_and_drop_unfinished() -> None:
    store = InMemoryStore()
    done, queued = await store.enqueue([Task(input={}), Task(input={})])
    claim = await store.claim("w1")
    assert claim is not None
    rows = [Transition(prompt_token_ids=[1], response_token_ids=[2], reward=0.5)]
    await store.complete(
        claim.attempt.attempt_id, AttemptResult(status="succeeded", reward=1.0, transitions=rows)
    )
    trajs = await trajectories_from_store(store, [done, queued.rollout_id])
    assert [t.rollout_id for t in trajs] == [done.rollout_id, queued.rollout_id]
    assert rewards_of(trajs[0]) == [0.5] and trajs[0].reward == 1.0
    assert trajs[1].transitions == [] and trajs[1].stats == {"dropped/unfinished": 1}


def test_rollouts_without_calls_or_with_no_explicit_transitions_are_dropped_and_counted() -> None:
    assert build_trajectory(rollout(), []).stats == {"dropped/no_calls": 1}
    traj = build_trajectory(rollout(), chain(2), transitions=[])
    assert traj.transitions == [] and traj.stats == {"dropped/no_transitions": 1}


async def test_trajectories_from_store_fill_a_failed_rollout_from_its_last_attempt() -> None:
    store = InMemoryStore()
    (ro,) = await store.enqueue([Task(task_id="grp", input={})], max_attempts=1)
    claim = await store.claim("w1")
    assert claim is not None
    aid = claim.attempt.attempt_id
    await store.add_llm_calls(
        [
            LLMCall(
                rollout_id=ro.rollout_id,
                attempt_id=aid,
                prompt_token_ids=[1],
                response_token_ids=[2],
            )
        ]
    )
    await store.complete(aid, AttemptResult(status="failed", error="boom"))

    (dropped,) = await trajectories_from_store(store, [ro])
    assert dropped.stats == {"dropped/failed": 1}
    config = TrajectoryConfig(failed_rollouts="fill", fill_reward=-1.0)
    (filled,) = await trajectories_from_store(store, [ro], config)
    assert rewards_of(filled) == [-1.0]
    assert filled.transitions[0].response_token_ids == [2]


async def test_a_reward_for_some_agents_is_never_the_rollouts_reward() -> None:
    """Through the store: with nothing returned, the rollout's reward is the last reward of
    the whole rollout, not a later one addressed to some agents."""
    store = InMemoryStore()
    (ro,) = await store.enqueue([Task(input={})])
    claim = await store.claim("w1")
    assert claim is not None
    aid = claim.attempt.attempt_id

    def rw(value: float, **meta: Any) -> Reward:
        return Reward(rollout_id=ro.rollout_id, attempt_id=aid, value=value, metadata=meta)

    emitted = [rw(0.5), rw(1.0, agents="wolves/.*"), rw(0.0, agents="village/.*")]
    await store.complete(aid, AttemptResult(status="succeeded", rewards=emitted))
    assert (await store.get_rollout(ro.rollout_id)).reward == 0.5
    wolf = call(0, [1], [2], agent="wolves/p1", attempt_id=aid)
    await store.add_llm_calls([wolf.model_copy(update={"rollout_id": ro.rollout_id})])
    [traj] = await trajectories_from_store(store, [ro.rollout_id])
    assert [t.reward for t in traj.transitions] == [1.0]
