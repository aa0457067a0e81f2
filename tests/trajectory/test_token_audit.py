"""The token-drift audit over recorded calls: the template check, the continuation check (the
builder's merge condition), reasons counted for what cannot be checked, trained-token drift,
and the builder's ``audit`` option that warns or raises on it."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from voltrl.errors import TokenDriftError
from voltrl.models.tiny import build_tiny_tokenizer
from voltrl.trajectory import TrajectoryConfig, build, build_trajectory
from voltrl.trajectory.audit import (
    AuditCounts,
    audit_calls,
    summarize,
)
from voltrl.types import LLMCall, Rollout, Task, Transition

RID, AID = "ro-a", "at-a"
TOK = build_tiny_tokenizer()


def chat_call(
    seq: int,
    messages: list[dict[str, Any]],
    answer: str,
    *,
    agent: str | None = "writer",
    prompt: list[int] | None = None,
    model: str | None = "tiny",
) -> LLMCall:
    """A chat call whose prompt ids are what the template makes of ``messages`` (unless
    ``prompt`` says otherwise) and whose response is ``answer`` and the end of turn."""
    text = TOK.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = TOK.encode(text, add_special_tokens=False) if prompt is None else prompt
    response = [
        *TOK.encode(answer, add_special_tokens=False),
        TOK.convert_tokens_to_ids("<|im_end|>"),
    ]
    return LLMCall(
        rollout_id=RID,
        attempt_id=AID,
        sequence_id=seq,
        agent_name=agent,
        request={"messages": messages},
        prompt_token_ids=ids,
        response_token_ids=response,
        model=model,
        started_at=float(seq),
    )


def conversation(second_sees: str) -> list[LLMCall]:
    """Two calls of one agent: the second sends back the first answer as ``second_sees``."""
    user = {"role": "user", "content": "Say a."}
    first = chat_call(0, [user], " a a ")
    again = [
        user,
        {"role": "assistant", "content": second_sees},
        {"role": "user", "content": "Again."},
    ]
    return [first, chat_call(1, again, "a")]


def rollout() -> Rollout:
    return Rollout(
        rollout_id=RID, task=Task(task_id="t", input={}), status="succeeded", reward=1.0,
        final_attempt_id=AID,
    )  # fmt: skip


def test_calls_whose_prompts_render_and_continue_exactly_are_identical() -> None:
    audit = audit_calls(conversation(" a a "), TOK)
    first, second = audit.calls
    assert first.template.outcome == second.template.outcome == "identical"
    assert first.continuation.reason == "first_call"
    assert second.continuation.outcome == "identical" and second.previous_call_id == first.call_id
    counts = audit.counts
    assert (counts.audited, counts.identical, counts.diverging) == (2, 2, 0)
    assert (counts.merged, counts.split, counts.merge_rate) == (1, 0, 1.0)
    assert counts.reasons == {"continuation/first_call": 1}


def test_an_answer_sent_back_stripped_diverges_at_the_first_token_that_differs() -> None:
    calls = conversation("a a")  # the first answer was " a a ": the client stripped it
    audit = audit_calls(calls, TOK)
    second = audit.calls[1]
    assert second.outcome == "diverges" and second.template.outcome == "identical"
    split = second.continuation.divergence
    assert split is not None
    expected = calls[0].prompt_token_ids + calls[0].response_token_ids  # type: ignore[operator]
    recorded = calls[1].prompt_token_ids
    assert split.position == len(calls[0].prompt_token_ids) == 13  # type: ignore[arg-type]
    assert expected[: split.position] == recorded[: split.position]  # type: ignore[index]
    assert split.expected == tuple(expected[split.position : split.position + 4])
    assert split.expected_text is not None and split.expected_text.startswith(" a")
    assert split.recorded_text is not None and split.recorded_text.startswith("a")
    assert "⟦expected" in split.marked()
    assert (audit.counts.merged, audit.counts.split, audit.counts.merge_rate) == (0, 1, 0.0)
    assert second.continuation.detail == "answer" and audit.counts.split_rebuilt == 0
    assert "in the previous answer" in second.continuation.describe()


def test_a_conversation_rebuilt_before_the_previous_answer_is_told_apart_from_drift() -> None:
    """A second call whose history changed before the first answer (a new conversation, a
    multi-agent formatter's history rendered anew) splits the row too, but it is no answer sent
    back changed: counted as ``split_rebuilt``."""
    first, _ = conversation(" a a ")
    again = [
        {"role": "user", "content": "Say b."},  # not the first call's user turn
        {"role": "assistant", "content": " a a "},
        {"role": "user", "content": "Again."},
    ]
    audit = audit_calls([first, chat_call(1, again, "a")], TOK)
    check = audit.calls[1].continuation
    assert check.outcome == "diverges" and check.detail == "rebuilt"
    assert check.divergence is not None
    assert check.divergence.position < len(first.prompt_token_ids or [])
    assert "the conversation was rebuilt" in check.describe()
    assert (audit.counts.split, audit.counts.split_rebuilt) == (1, 1)


def test_prompt_ids_that_are_not_the_rendered_messages_fail_the_template_check() -> None:
    user = [{"role": "user", "content": "hi"}]
    rendered = TOK.encode(
        TOK.apply_chat_template(user, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    changed = [*rendered[:3], 7, *rendered[4:]]
    (audit,) = audit_calls([chat_call(0, user, "x", prompt=changed)], TOK).calls
    assert audit.template.outcome == "diverges" and audit.template.divergence.position == 3  # type: ignore[union-attr]
    shorter = audit_calls([chat_call(0, user, "x", prompt=rendered[:-1])], TOK).calls[0]
    assert shorter.template.divergence.position == len(rendered) - 1  # type: ignore[union-attr]


def test_what_cannot_be_checked_is_counted_with_its_reason() -> None:
    user = [{"role": "user", "content": "hi"}]
    no_ids = chat_call(0, user, "x").model_copy(
        update={"prompt_token_ids": None, "response_token_ids": None}
    )
    completion = LLMCall(
        rollout_id=RID, attempt_id=AID, sequence_id=1, agent_name="w", request={"prompt": "hi"},
        prompt_token_ids=[1, 2], response_token_ids=[3],
    )  # fmt: skip
    bad = chat_call(2, [{"role": "robot", "content": "?"}], "x", prompt=[1], agent="r")
    other = chat_call(3, user, "y", agent="r", model="adapter")
    after_no_ids = chat_call(4, user, "z", agent="writer")
    audit = audit_calls([no_ids, completion, bad, other, after_no_ids], TOK)
    reasons = audit.counts.reasons
    assert reasons == {
        "continuation/first_call": 2,
        "continuation/no_token_ids": 1,
        "continuation/other_model": 1,
        "continuation/previous_no_token_ids": 1,
        "template/no_messages": 1,
        "template/no_token_ids": 1,
        "template/template_error": 1,
    }
    assert audit.counts.not_checkable == 3  # no ids; /completions first call; bad roles first
    assert "role" in (audit.calls[2].template.detail or "")  # the template's own words
    assert audit_calls([after_no_ids], None).counts.reasons == {
        "continuation/first_call": 1,
        "template/no_tokenizer": 1,
    }


def test_each_agent_continues_its_own_previous_call_and_a_cut_off_call_is_skipped() -> None:
    user = {"role": "user", "content": "Go."}
    first = chat_call(0, [user], "a")
    cut = chat_call(1, [user], "b").model_copy(update={"finish_reason": "abandoned"})
    checker = chat_call(2, [user], "c", agent="checker")
    again = [user, {"role": "assistant", "content": "a"}, {"role": "user", "content": "More."}]
    follow = chat_call(3, again, "d")
    audit = audit_calls([follow, checker, cut, first], TOK)  # any order: the builder's is used
    assert [c.sequence_id for c in audit.calls] == [0, 1, 2, 3]
    assert audit.calls[3].previous_call_id == first.call_id
    assert audit.calls[3].continuation.outcome == "identical"
    assert audit.calls[2].continuation.reason == "first_call"  # the checker's own first
    by_agent = audit.by_agent()
    assert by_agent["checker"].calls == 1 and by_agent["writer"].calls == 3


def test_a_runs_summary_sums_its_rollouts() -> None:
    audits = [audit_calls(conversation(" a a "), TOK), audit_calls(conversation("a a"), TOK)]
    summary = summarize(audits)
    assert summary.rollouts == 2 and summary.counts.calls == 4
    assert (summary.counts.merged, summary.counts.split) == (1, 1)
    assert [c.sequence_id for c in summary.diverging] == [1]
    assert summary.agents["writer"].diverging == 1
    assert (AuditCounts() + summary.counts).as_dict()["merge_rate"] == 0.5


# ---- trained-token drift ---------------------------------------------------------------------


def sampled() -> list[LLMCall]:
    return [
        LLMCall(rollout_id=RID, attempt_id=AID, sequence_id=0, prompt_token_ids=[1],
                response_token_ids=[5, 6, 7], agent_name="a"),
        LLMCall(rollout_id=RID, attempt_id=AID, sequence_id=1, prompt_token_ids=[1, 5, 6, 7, 9],
                response_token_ids=[8, 8], agent_name="a"),
    ]  # fmt: skip


def test_explicit_transitions_of_sampled_tokens_are_no_drift_and_altered_ones_are_named() -> None:
    calls = sampled()
    merged = Transition(
        prompt_token_ids=[1],
        response_token_ids=[5, 6, 7, 9, 8, 8],
        response_mask=[1, 1, 1, 0, 1, 1],
    )
    joined = Transition(prompt_token_ids=[1], response_token_ids=[5, 6, 7, 8, 8])
    altered = Transition(prompt_token_ids=[1], response_token_ids=[5, 6, 4], agent_name="a")
    audit = audit_calls(calls, TOK, transitions=[merged, joined, altered])
    (drift,) = audit.trained_drift
    assert (drift.kind, drift.transition, drift.position) == ("transition", 2, 2)
    assert drift.call_id == calls[0].call_id and "position 2" in drift.describe()
    assert audit.counts.trained_drift == 1
    nothing = audit_calls([], None, transitions=[joined], rollout_id=RID).trained_drift
    assert nothing[0].position == 0 and nothing[0].call_id is None


def test_the_builder_warns_once_per_kind_or_raises_on_trained_token_drift(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build, "_warned_drift", set())  # none warned of yet in this process
    altered = [Transition(prompt_token_ids=[1], response_token_ids=[5, 6, 4], agent_name="a")]
    with caplog.at_level(logging.WARNING, logger="voltrl.trajectory"):
        traj = build_trajectory(rollout(), sampled(), transitions=altered)
    assert traj.stats["trained_token_drift"] == 1 and len(traj.transitions) == 1
    (warning,) = [r.getMessage() for r in caplog.records if "drift" in r.getMessage()]
    assert RID in warning and "transition 0" in warning and "position 2" in warning
    with pytest.raises(TokenDriftError, match=r"rollout ro-a: .*position 2"):
        build_trajectory(
            rollout(), sampled(), transitions=altered, config=TrajectoryConfig(audit="error")
        )
    off = build_trajectory(
        rollout(), sampled(), transitions=altered, config=TrajectoryConfig(audit="off")
    )
    assert "trained_token_drift" not in off.stats
    exact = [Transition(prompt_token_ids=[1], response_token_ids=[5, 6, 7], agent_name="a")]
    config = TrajectoryConfig(audit="error")
    assert build_trajectory(rollout(), sampled(), transitions=exact, config=config).transitions


def test_a_retokenized_call_is_trained_token_drift() -> None:
    calls = [sampled()[0].model_copy(update={"prompt_token_ids": None, "response_token_ids": None})]
    config = TrajectoryConfig(
        missing_token_ids="retokenize", retokenizer=lambda c: ([1], [2]), audit="error"
    )
    with pytest.raises(TokenDriftError, match=f"call {calls[0].call_id} .*re-tokenized"):
        build_trajectory(rollout(), calls, config=config)
    (drift,) = audit_calls(calls, None, config=config).trained_drift
    assert drift.kind == "retokenized"


def test_a_rate_is_never_shown_as_100_or_0_percent_when_it_is_not() -> None:
    from voltrl.trajectory.audit import percent

    assert percent(2319 / 2320) == ">99.9%" and percent(1.0) == "100.0%"
    assert percent(1 / 5000) == "<0.1%" and percent(0.0) == "0.0%"
    assert percent(0.5, 0) == "50%" and percent(None) == "-"
