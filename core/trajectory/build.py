"""Build a rollout's trajectory: its final attempt's records → credit → rows → counts."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from voltrl.errors import TokenDriftError
from voltrl.trajectory.audit import TrainedDrift, retokenized_drift, transition_drift
from voltrl.trajectory.config import TrajectoryConfig
from voltrl.trajectory.credit import (
    agent_final_rewards,
    air_rewards_per_turn,
    assign_credit,
    final_reward,
    step_rewards_per_turn,
)
from voltrl.trajectory.rows import (
    Row,
    cap,
    fit_lengths,
    merge_turns,
    row_of,
    rows_from_transitions,
    turns,
)
from voltrl.types import (
    ABANDONED_SPAN,
    REFUSED_SPAN,
    LLMCall,
    Reward,
    Rollout,
    Span,
    Trajectory,
    Transition,
)

if TYPE_CHECKING:
    from voltrl.store.base import Store

logger = logging.getLogger("voltrl.trajectory")

_warned_unrewarded: set[str] = set()  # agent names already named in a warning, this process
_warned_drift: set[str] = set()  # kinds of trained-token drift already warned of, this process


def build_trajectory(
    rollout: Rollout,
    calls: Sequence[LLMCall],
    rewards: Sequence[Reward] = (),
    spans: Sequence[Span] | None = None,
    config: TrajectoryConfig | None = None,
    *,
    transitions: Sequence[Transition] | None = None,
    attempt_id: str | None = None,
) -> Trajectory:
    """Build one rollout's training rows.

    ``calls``, ``rewards`` and ``spans`` are the rollout's records; only those of
    ``attempt_id`` (default: ``rollout.final_attempt_id``, else the last call's attempt)
    are used. ``transitions`` (the attempt's explicit transitions) replace the calls when
    given. A rollout that is dropped comes back with no transitions and its reason in
    ``stats`` (``dropped/failed``, ``dropped/cancelled``, ``dropped/unfinished``,
    ``dropped/no_reward``, ``dropped/no_calls``, ``dropped/no_transitions``, and
    ``dropped/no_trainable_calls`` when every call was left out). A rollout whose only
    rewards are addressed to agents (``emit_reward(v, agents=...)``) trains the calls they
    address; the others are counted as ``dropped/no_agent_reward``. Calls the backend
    refused (``gateway.refused`` spans) are counted as ``refused/<error code>``, e.g.
    ``refused/context_length_exceeded``; calls the gateway cut off (``gateway.abandoned``
    spans) as ``abandoned/<reason>``, and the part of one that was recorded (finish reason
    ``abandoned``) is never trained: ``dropped/abandoned_call``.
    """
    config = config or TrajectoryConfig()
    stats: Counter[str] = Counter()
    aid = attempt_id or rollout.final_attempt_id or (calls[-1].attempt_id if calls else None)
    calls = sorted(
        (c for c in calls if aid is None or c.attempt_id == aid),
        key=lambda c: (c.sequence_id is None, c.sequence_id or 0, c.started_at),
    )
    rewards = [r for r in rewards if aid is None or r.attempt_id == aid]
    spans = [s for s in spans or () if aid is None or s.attempt_id == aid]

    def result(rows: list[Row], reward: float | None) -> Trajectory:
        return Trajectory(
            rollout_id=rollout.rollout_id,
            task_id=rollout.task.task_id,
            transitions=[r.transition() for r in rows],
            reward=reward,
            merge_failures=stats["merge_failures"],
            stats={k: v for k, v in stats.items() if v},
        )

    for span in spans:  # calls the backend refused never became calls: count them here
        if span.name == REFUSED_SPAN:
            stats[f"refused/{span.attributes.get('error.type', 'unknown')}"] += 1
        elif span.name == ABANDONED_SPAN:
            stats[f"abandoned/{span.attributes.get('voltrl.cut_reason', 'unknown')}"] += 1
    final, reason = final_reward(rollout, rewards, config)
    if reason is None and transitions is None and not calls:
        reason = "no_calls"
    elif reason is None and transitions is not None and not transitions:
        reason = "no_transitions"
    if reason is not None:
        stats[f"dropped/{reason}"] += 1
        return result([], None)

    if transitions is not None:
        finals = agent_final_rewards([t.agent_name for t in transitions], rewards, final)
        n = len(transitions)
        credit = _credit(finals, [0.0] * n, [0.0] * n, config)
        rows = rows_from_transitions(transitions, credit, config, stats)
        given = [
            t.reward if t.reward is not None else c
            for t, c in zip(transitions, credit, strict=True)
        ]
        _warn_unrewarded([t.agent_name for t in transitions], given, config)
    else:
        finals = agent_final_rewards([c.agent_name for c in calls], rewards, final)
        step = (
            step_rewards_per_turn(calls, rewards)
            if config.credit == "per_step"
            else [0.0] * len(calls)
        )
        credit = _credit(finals, step, air_rewards_per_turn(calls, spans, config), config)
        trained = turns(calls, finals, config, stats)
        if config.mode == "trajectory":
            rows = merge_turns(trained, stats)
        else:
            rows = [row_of(turn) for turn in trained]
        for row in rows:
            row.reward = credit[row.first_turn]
        _warn_unrewarded([c.agent_name for c in calls], finals, config)
    kept = cap(fit_lengths(rows, config, stats), config, stats)
    if not kept:
        stats["dropped/no_trainable_calls"] += 1
    if config.audit != "off":
        drift = _trained_drift(rollout.rollout_id, kept, calls, transitions)
        stats["trained_token_drift"] += len(drift)
        _report_drift(rollout.rollout_id, drift, config)
    return result(kept, final)


def _trained_drift(
    rollout_id: str,
    rows: Sequence[Row],
    calls: Sequence[LLMCall],
    transitions: Sequence[Transition] | None,
) -> list[TrainedDrift]:
    """The rows to train whose tokens were not sampled: explicit transitions whose generated
    tokens no call sampled, calls re-tokenized."""
    by_id = {c.call_id: c for c in calls}
    drift: list[TrainedDrift] = []
    for row in rows:
        if row.metadata.get("explicit") and transitions is not None:
            found = transition_drift(transitions[row.first_turn], row.first_turn, calls, rollout_id)
            drift += [found] if found is not None else []
        elif row.metadata.get("retokenized"):
            retokenized = [by_id[i] for i in row.call_ids if not by_id[i].has_token_ids]
            drift += [retokenized_drift(c) for c in retokenized]
    return drift


def _report_drift(rollout_id: str, drift: Sequence[TrainedDrift], config: TrajectoryConfig) -> None:
    """:class:`TokenDriftError` with ``audit="error"``; else a warning for the first rollout
    with each kind of drift in this process (an agent's bug repeats in every rollout: the
    others are counted, as every one is)."""
    if not drift or (config.audit == "warn" and {d.kind for d in drift} <= _warned_drift):
        return
    found = "; ".join(d.describe() for d in drift[:5])
    more = f"; and {len(drift) - 5} more" if len(drift) > 5 else ""
    message = (
        f"trained-token drift: {len(drift)} of the rows to train are not the tokens the model "
        f"sampled: {found}{more} (docs/fidelity.md)"
    )
    if config.audit == "error":
        raise TokenDriftError(message, rollout_id)
    _warned_drift.update(d.kind for d in drift)
    logger.warning(
        "rollout %s: %s; counted as trained_token_drift, here and in the later rollouts, which "
        'are not warned of again (TrajectoryConfig(audit="error") stops the run)',
        rollout_id,
        message,
    )


def _credit(
    finals: Sequence[float | None],
    step_rewards: Sequence[float],
    air_rewards: Sequence[float],
    config: TrajectoryConfig,
) -> list[float | None]:
    """Each turn's credit; None for a turn with no final reward (it is left out). Such turns
    still count as turns, with a final of 0, for the discounting and chaining of the rest."""
    credit = assign_credit([f or 0.0 for f in finals], step_rewards, air_rewards, config)
    return [None if f is None else c for f, c in zip(finals, credit, strict=True)]


def _warn_unrewarded(
    agent_names: Sequence[str | None], finals: Sequence[float | None], config: TrajectoryConfig
) -> None:
    """Warn once per process per agent name that its calls had no reward at all."""
    names = {
        name or ""
        for name, f in zip(agent_names, finals, strict=True)
        if f is None and config.trains_agent(name)
    }
    new = sorted(names - _warned_unrewarded)
    if new:
        _warned_unrewarded.update(new)
        logger.warning(
            "calls of agents %s are left out of training: the rollout has no reward of its "
            "own (none returned, none emitted without agents=) and no emit_reward(..., "
            "agents=REGEX) matches their name; counted as dropped/no_agent_reward (shown once "
            "per agent name)",
            new,
        )


async def trajectories_from_store(
    store: Store, rollouts: Sequence[Rollout | str], config: TrajectoryConfig | None = None
) -> list[Trajectory]:
    """Build each rollout's trajectory from the store, in the order given, dropped ones
    included. Rollouts are re-read (a ``Rollout`` passed in may be stale); the records used
    are those of the final attempt, or of the last attempt when there is no final one."""

    async def one(ref: Rollout | str) -> Trajectory:
        rid = ref if isinstance(ref, str) else ref.rollout_id
        rollout = await store.get_rollout(rid)
        attempts = await store.get_attempts(rid)
        attempt = next(
            (a for a in attempts if a.attempt_id == rollout.final_attempt_id),
            attempts[-1] if attempts else None,
        )
        if attempt is None:
            return build_trajectory(rollout, [], [], [], config)
        calls, rewards, spans = await asyncio.gather(
            store.get_llm_calls(rid, attempt.attempt_id),
            store.get_rewards(rid, attempt.attempt_id),
            store.get_spans(rid, attempt.attempt_id),
        )
        return build_trajectory(
            rollout,
            calls,
            rewards,
            spans,
            config,
            transitions=attempt.transitions,
            attempt_id=attempt.attempt_id,
        )

    return list(await asyncio.gather(*(one(r) for r in rollouts)))
