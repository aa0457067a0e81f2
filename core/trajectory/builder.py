"""The trajectory builder: a rollout's LLM calls and rewards become training rows.

Plain functions, composable::

    trajectory = build_trajectory(rollout, calls, rewards, spans, config)   # one rollout
    batch = collate([trajectory, ...], config)                              # padded lists
    trajectories = await trajectories_from_store(store, rollouts, config)   # fetch + build

Everything is set by one :class:`TrajectoryConfig`; ``docs/trajectory.md`` explains each
option with examples. In short:

**Which attempt.** The rollout's ``final_attempt_id`` (the winning attempt); for a rollout
that has none (failed), the attempt of the last call given. Calls of other attempts are ignored.
Calls are ordered by ``sequence_id``; a call's *turn* is its position among all calls of the
attempt, whatever agent made it and whether or not it is trained on.

**Rows.** ``mode="transition"`` (default): one row per call. ``mode="trajectory"``: a call
whose prompt ids start with the previous call's prompt + response ids (previous call of the
same agent, sampled by the same model) extends that row: the tokens in between (tool results,
the next user turn) join the response with loss mask 0 and logprob 0, the new generated
tokens follow with mask 1. A row records its first call's ``model``. A call that does not
extend its agent's open row starts a new row and counts one merge failure; a call sampled by
another model (another LoRA adapter) starts a new row without counting one.
Explicit transitions returned by the agent (``Attempt.transitions``) are used as-is instead.

**Calls without token ids** (``missing_token_ids``): ``"drop"`` (default; counted as
``dropped/missing_token_ids``), ``"error"`` (raise :class:`MissingTokenIdsError`), or
``"retokenize"`` with ``retokenizer(call) -> (prompt_ids, response_ids)`` (logprobs unknown;
the row's ``metadata["retokenized"]`` is true, and ``stats["retokenized"]`` counts the calls).
LocalRL's :func:`~voltrl.algorithms.local.chat.chat_retokenizer` renders a call with the
student's chat template.

**Rewards.** The final reward is ``Rollout.reward`` (the returned reward, else the last one
emitted), else the last reward record. Credit (``credit``), per turn ``t`` of ``T``:

- ``"final"`` (default): every turn gets the final reward ``R``.
- ``"discounted"``: turn ``t`` gets ``gamma**(T-1-t) * R``.
- ``"per_step"``: each reward record belongs to the last call that ended at or before its
  timestamp (rewards before any call belong to the first); ``G_t = r_t + gamma * G_{t+1}``,
  plus ``R`` on every turn when ``per_step_add_final``. Records with source ``"return"``
  are the final reward, never step rewards.
- Agents' own finals: a reward emitted with ``agents=REGEX`` (``emit_reward(1.0,
  agents="wolves/.*")``) is the final reward ``R`` of the calls whose agent name the regex
  fully matches (the last such reward wins), wherever ``R`` is used (``final``,
  ``discounted``, ``per_step`` with ``per_step_add_final``); it is neither a step reward nor
  the rollout's reward. Games credit each team's calls with its own outcome this way. Turns
  are counted over the whole rollout, all agents together: ``discounted`` and ``per_step``
  with ``gamma > 0`` discount and chain across agents, so several teams call for ``gamma=0``
  (each call: its own step rewards plus its team's ``R``). Explicit transitions keep the
  rewards the agent gave them.
- AIR (``air=True``): each tool call a turn issued adds ``air_success_reward`` or
  ``air_failure_reward`` to that turn's own reward (propagated through ``G`` in
  ``per_step`` mode, added as-is otherwise). A tool call's result is the ``role: "tool"``
  message answering it in a later call's request (by ``tool_call_id``; without ids, the tool
  messages after the last assistant message of the next call's request), judged by
  ``air_is_error`` (default :func:`default_tool_error`). An ``"error"`` span with a tool-call
  attribute marks the tool call whose id it carries as failed; one without a known id adds a
  failure to the call that issued it, unless messages already showed one.

A row's reward is the credit of its first turn (in trajectory mode, the return from where the
merged sequence starts) and sits on its last generated token in ``token_level_rewards``.

**Selection.** ``agent_filter``: a regex that must fully match a call's agent name (``""``
when unnamed) for it to be trained on. Length limits with ``length_policy`` ``"truncate"``
(prompt keeps its end, response its start) or ``"drop"``. ``max_transitions_per_rollout=K``
keeps K rows evenly spaced over the rollout, always including the first and the last:
indices ``j * (n - 1) // (K - 1)`` (the last row alone when ``K == 1``); deterministic, no
randomness. Failed rollouts: ``"drop"`` (default) or ``"fill"`` with ``fill_reward`` as the
final reward. Cancelled or unfinished rollouts are always dropped. Nothing is dropped
silently: every drop is counted in the trajectory's and the batch's ``stats``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from voltrl.errors import MissingTokenIdsError
from voltrl.gateway.errors import REFUSED_SPAN
from voltrl.types import LLMCall, Model, Reward, Rollout, Span, Trajectory, Transition

if TYPE_CHECKING:
    from voltrl.store.base import Store

Retokenizer = Callable[[LLMCall], tuple[list[int], list[int]]]
"""Turns a call recorded without token ids into ``(prompt_ids, response_ids)``."""

TOOL_CALL_ID_ATTRIBUTES = ("gen_ai.tool.call.id", "tool_call_id", "tool.call_id")
TOOL_ATTRIBUTES = (*TOOL_CALL_ID_ATTRIBUTES, "gen_ai.tool.name", "tool.name", "tool_name")


def default_tool_error(content: str) -> bool:
    """Whether a tool result reads as a failure: it starts with ``Error``, contains a Python
    traceback, or is a JSON object with a non-empty ``"error"`` field."""
    text = content.strip()
    if text.startswith("Error") or "Traceback (most recent call last)" in text:
        return True
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            return False
        return isinstance(obj, dict) and obj.get("error") not in (None, False, "", {}, [])
    return False


class TrajectoryConfig(Model):
    """How rollouts become training rows. See the module docstring and docs/trajectory.md."""

    mode: Literal["transition", "trajectory"] = "transition"
    credit: Literal["final", "discounted", "per_step"] = "final"
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    per_step_add_final: bool = False
    air: bool = False
    air_success_reward: float = 0.0
    air_failure_reward: float = -0.1
    air_is_error: Callable[[str], bool] = Field(default=default_tool_error, exclude=True)
    agent_filter: str | None = None
    max_transitions_per_rollout: int | None = Field(None, ge=1)
    max_prompt_length: int | None = Field(None, ge=1)
    max_response_length: int | None = Field(None, ge=1)
    length_policy: Literal["truncate", "drop"] = "truncate"
    failed_rollouts: Literal["drop", "fill"] = "drop"
    fill_reward: float = 0.0
    missing_token_ids: Literal["drop", "error", "retokenize"] = "drop"
    retokenizer: Retokenizer | None = Field(default=None, exclude=True)
    pad_token_id: int = 0
    pad_to_max_lengths: bool = False

    @field_validator("agent_filter")
    @classmethod
    def _valid_regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"agent_filter is not a valid regex: {e}") from None
        return v

    @model_validator(mode="after")
    def _retokenizer_given(self) -> TrajectoryConfig:
        if self.missing_token_ids == "retokenize" and self.retokenizer is None:
            raise ValueError('missing_token_ids="retokenize" needs a retokenizer callable')
        return self

    def trains_agent(self, agent_name: str | None) -> bool:
        """Whether calls of this agent are trained on (``agent_filter`` fully matches)."""
        return (
            self.agent_filter is None
            or re.fullmatch(self.agent_filter, agent_name or "") is not None
        )


# ---- credit assignment ----------------------------------------------------------------------


def assign_credit(
    final: float | Sequence[float],
    step_rewards: Sequence[float],
    air_rewards: Sequence[float],
    config: TrajectoryConfig,
) -> list[float]:
    """Each turn's credit from the final reward (one for all turns, or one per turn when
    agents have finals of their own), its own step rewards and its AIR rewards (lists with
    one entry per turn); see the module docstring for the rules."""
    n, g = len(step_rewards), config.gamma
    finals = [final] * n if isinstance(final, int | float) else list(final)
    if config.credit == "final":
        return [f + a for f, a in zip(finals, air_rewards, strict=True)]
    if config.credit == "discounted":
        return [g ** (n - 1 - t) * finals[t] + air_rewards[t] for t in range(n)]
    returns, nxt = [0.0] * n, 0.0
    for t in reversed(range(n)):
        nxt = returns[t] = step_rewards[t] + air_rewards[t] + g * nxt
    if not config.per_step_add_final:
        return returns
    return [r + f for r, f in zip(returns, finals, strict=True)]


def agent_final_rewards(
    calls: Sequence[LLMCall], rewards: Sequence[Reward], final: float
) -> list[float]:
    """Each call's final reward: the last emitted reward addressed to its agent (metadata
    ``agents``, a regex fully matching the call's agent name), else the rollout's ``final``."""
    addressed = [(re.compile(r.agents), r.value) for r in rewards if r.agents is not None]
    out = []
    for call in calls:
        matching = [v for pattern, v in addressed if pattern.fullmatch(call.agent_name or "")]
        out.append(matching[-1] if matching else final)
    return out


def _end(call: LLMCall) -> float:
    return call.ended_at if call.ended_at is not None else call.started_at


def owner_turn(calls: Sequence[LLMCall], timestamp: float) -> int:
    """The turn a timestamped event belongs to: the last call (latest end, then latest turn)
    that ended at or before ``timestamp``; the first call when none had."""
    done = [(_end(c), i) for i, c in enumerate(calls) if _end(c) <= timestamp]
    return max(done)[1] if done else 0


def step_rewards_per_turn(calls: Sequence[LLMCall], rewards: Sequence[Reward]) -> list[float]:
    """Sum of the reward records owned by each turn (records with source ``"return"`` are the
    final reward and are skipped)."""
    out = [0.0] * len(calls)
    for rw in rewards:
        if rw.source != "return" and rw.agents is None and calls:
            out[owner_turn(calls, rw.timestamp)] += rw.value
    return out


# ---- automatic intermediate rewards (tool success / failure) ------------------------------------


def assistant_message(call: LLMCall) -> dict[str, Any]:
    """The assistant message of a call, from a full response or a bare choice/message."""
    resp = call.response
    choices = resp.get("choices")
    if isinstance(choices, list) and choices:
        chosen = next((c for c in choices if c.get("index") == call.choice_index), choices[0])
        return chosen.get("message") or {}
    return resp.get("message") or resp


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _request_messages(call: LLMCall) -> list[dict[str, Any]]:
    msgs = call.request.get("messages")
    return [m for m in msgs if isinstance(m, dict)] if isinstance(msgs, list) else []


def tool_outcomes(
    calls: Sequence[LLMCall], spans: Sequence[Span], is_error: Callable[[str], bool]
) -> list[list[bool]]:
    """For each call, one ``failed`` flag per tool call it issued whose result was seen."""
    found: list[dict[str | int, bool]] = [{} for _ in calls]
    for i, call in enumerate(calls):
        tool_calls = assistant_message(call).get("tool_calls") or []
        ids = [tc.get("id") for tc in tool_calls if isinstance(tc, dict)]
        if not ids:
            continue
        if all(ids):
            for later in calls[i + 1 :]:
                for m in _request_messages(later):
                    cid = m.get("tool_call_id")
                    if m.get("role") == "tool" and cid in ids and cid not in found[i]:
                        found[i][cid] = is_error(_text(m.get("content")))
                if found[i]:
                    break
        elif i + 1 < len(calls):
            msgs = _request_messages(calls[i + 1])
            last = max((k for k, m in enumerate(msgs) if m.get("role") == "assistant"), default=-1)
            tool_msgs = [m for m in msgs[last + 1 :] if m.get("role") == "tool"]
            for k, m in enumerate(tool_msgs):
                found[i][k] = is_error(_text(m.get("content")))
    owner_of = {cid: i for i, f in enumerate(found) for cid in f if isinstance(cid, str)}
    for span in spans:
        attrs = span.attributes
        if span.status != "error" or not calls or not any(a in attrs for a in TOOL_ATTRIBUTES):
            continue
        cid = next((attrs[a] for a in TOOL_CALL_ID_ATTRIBUTES if a in attrs), None)
        if cid in owner_of:
            found[owner_of[cid]][cid] = True
            continue
        i = owner_turn(calls, span.start_time)
        if not any(found[i].values()):
            found[i][f"span:{span.span_id}"] = True
    return [list(f.values()) for f in found]


def air_rewards_per_turn(
    calls: Sequence[LLMCall], spans: Sequence[Span], config: TrajectoryConfig
) -> list[float]:
    """AIR reward of each turn (zeros when ``config.air`` is off)."""
    if not config.air:
        return [0.0] * len(calls)
    return [
        sum(config.air_failure_reward if failed else config.air_success_reward for failed in f)
        for f in tool_outcomes(calls, spans, config.air_is_error)
    ]


# ---- rows -------------------------------------------------------------------------------------


@dataclass
class _Row:
    """A training row under construction: a prompt and a masked response."""

    prompt: list[int]
    agent_name: str | None
    model: str | None
    first_turn: int
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)
    reward: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def add(self, tokens: Sequence[int], generated: bool, logprobs: Sequence[float] | None) -> None:
        self.response += tokens
        self.mask += [int(generated)] * len(tokens)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)


@dataclass
class _Turn:
    index: int
    call: LLMCall
    prompt: list[int]
    response: list[int]
    logprobs: list[float] | None
    retokenized: bool = False


def _turns(calls: Sequence[LLMCall], config: TrajectoryConfig, stats: Counter[str]) -> list[_Turn]:
    """The calls to train on, with token ids resolved per ``missing_token_ids``."""
    out = []
    for i, call in enumerate(calls):
        if not config.trains_agent(call.agent_name):
            stats["dropped/agent_filter"] += 1
            continue
        prompt, response, logprobs = call.prompt_token_ids, call.response_token_ids, None
        retokenized = prompt is None or response is None
        if retokenized:
            if config.missing_token_ids == "error":
                raise MissingTokenIdsError(
                    f"call {call.call_id} (turn {i}) was recorded without token ids",
                    call.rollout_id,
                )
            if config.missing_token_ids == "drop":
                stats["dropped/missing_token_ids"] += 1
                continue
            prompt, response = config.retokenizer(call)  # type: ignore[misc]  # validated
            stats["retokenized"] += 1
        elif call.response_logprobs is not None and len(call.response_logprobs) == len(response):
            logprobs = call.response_logprobs
        if logprobs is None:
            stats["missing_logprobs"] += 1
        out.append(_Turn(i, call, list(prompt), list(response), logprobs, retokenized))
    return out


def _row_of(turn: _Turn) -> _Row:
    call = turn.call
    row = _Row(
        prompt=turn.prompt, agent_name=call.agent_name, model=call.model, first_turn=turn.index
    )
    _extend(row, turn, [])
    return row


def _extend(row: _Row, turn: _Turn, context: list[int]) -> None:
    row.add(context, False, None)
    row.add(turn.response, True, turn.logprobs)
    row.turns.append(turn.index)
    row.call_ids.append(turn.call.call_id)
    if turn.retokenized:
        row.metadata["retokenized"] = True


def _merge_turns(turns: Sequence[_Turn], stats: Counter[str]) -> list[_Row]:
    """Trajectory mode: each turn extends its agent's open row when its prompt starts with
    that row's prompt + response (counted as ``merged``); otherwise it opens a new row (one
    ``merge_failures``). The merge rate is ``merged / (merged + merge_failures)``."""
    rows: list[_Row] = []
    open_rows: dict[str | None, _Row] = {}
    for turn in turns:
        row = open_rows.get(turn.call.agent_name)
        if row is not None and row.model == turn.call.model:
            full = row.prompt + row.response
            if turn.prompt[: len(full)] == full:
                _extend(row, turn, turn.prompt[len(full) :])
                stats["merged"] += 1
                continue
            stats["merge_failures"] += 1
        row = open_rows[turn.call.agent_name] = _row_of(turn)
        rows.append(row)
    return rows


def _fit_lengths(rows: list[_Row], config: TrajectoryConfig, stats: Counter[str]) -> list[_Row]:
    """Apply the prompt/response length limits; drop rows left with no generated token."""
    kept = []
    p_max = config.max_prompt_length or float("inf")
    r_max = config.max_response_length or float("inf")
    for row in rows:
        too_long_p, too_long_r = len(row.prompt) > p_max, len(row.response) > r_max
        if (too_long_p or too_long_r) and config.length_policy == "drop":
            stats["dropped/too_long"] += 1
            continue
        if too_long_p:
            row.prompt = row.prompt[len(row.prompt) - int(p_max) :]
            row.metadata["truncated_prompt"] = True
            stats["truncated/prompt"] += 1
        if too_long_r:
            cut = int(r_max)
            row.response, row.mask, row.logprobs = (
                row.response[:cut],
                row.mask[:cut],
                row.logprobs[:cut],
            )
            row.metadata["truncated_response"] = True
            stats["truncated/response"] += 1
        if 1 not in row.mask:
            stats["dropped/empty_response"] += 1
            continue
        kept.append(row)
    return kept


def cap_indices(n: int, k: int | None) -> list[int]:
    """Indices of the rows kept under a cap of ``k`` out of ``n``: evenly spaced, always
    including the first and the last (only the last when ``k == 1``)."""
    if k is None or n <= k:
        return list(range(n))
    if k == 1:
        return [n - 1]
    return [j * (n - 1) // (k - 1) for j in range(k)]


def _cap(rows: list[_Row], config: TrajectoryConfig, stats: Counter[str]) -> list[_Row]:
    keep = cap_indices(len(rows), config.max_transitions_per_rollout)
    stats["dropped/over_cap"] += len(rows) - len(keep)
    return [rows[i] for i in keep]


def _rows_from_transitions(
    transitions: Sequence[Transition], final: float, config: TrajectoryConfig, stats: Counter[str]
) -> list[_Row]:
    """Explicit transitions as-is; one without a reward gets the credit of its position."""
    n = len(transitions)
    credit = assign_credit(final, [0.0] * n, [0.0] * n, config)
    rows = []
    for i, tr in enumerate(transitions):
        if not config.trains_agent(tr.agent_name):
            stats["dropped/agent_filter"] += 1
            continue
        response, mask, logprobs = tr.response_token_ids, tr.response_mask, tr.response_logprobs
        if mask is not None and len(mask) != len(response):
            raise ValueError(f"transition {i}: response_mask and response_token_ids differ")
        if logprobs is None or len(logprobs) != len(response):
            stats["missing_logprobs"] += 1
            logprobs = None
        row = _Row(
            prompt=list(tr.prompt_token_ids), agent_name=tr.agent_name, model=tr.model, first_turn=i
        )
        row.add(response, True, logprobs)
        row.mask = list(mask) if mask is not None else row.mask
        row.turns, row.reward = [i], tr.reward if tr.reward is not None else credit[i]
        row.metadata = {**tr.metadata, "explicit": True}
        rows.append(row)
    return rows


def _final_reward(
    rollout: Rollout, rewards: Sequence[Reward], config: TrajectoryConfig
) -> tuple[float | None, str | None]:
    """The final reward, or the reason the rollout is dropped."""
    if rollout.status == "failed":
        return (config.fill_reward, None) if config.failed_rollouts == "fill" else (None, "failed")
    if rollout.status == "cancelled":
        return None, "cancelled"
    if rollout.status != "succeeded":
        return None, "unfinished"
    if rollout.reward is not None:
        return rollout.reward, None
    returned = [r for r in rewards if r.source == "return"] or [
        r for r in rewards if r.agents is None
    ]
    return (returned[-1].value, None) if returned else (None, "no_reward")


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
    ``dropped/no_trainable_calls`` when every call was filtered out or too long). Calls the
    backend refused (``gateway.refused`` spans) are counted as ``refused/<error code>``, e.g.
    ``refused/context_length_exceeded``.
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

    def result(rows: list[_Row], reward: float | None) -> Trajectory:
        return Trajectory(
            rollout_id=rollout.rollout_id,
            task_id=rollout.task.task_id,
            transitions=[_transition(r) for r in rows],
            reward=reward,
            merge_failures=stats["merge_failures"],
            stats={k: v for k, v in stats.items() if v},
        )

    for span in spans:  # calls the backend refused never became calls: count them here
        if span.name == REFUSED_SPAN:
            stats[f"refused/{span.attributes.get('error.type', 'unknown')}"] += 1
    final, reason = _final_reward(rollout, rewards, config)
    if reason is None and transitions is None and not calls:
        reason = "no_calls"
    elif reason is None and transitions is not None and not transitions:
        reason = "no_transitions"
    if reason is not None:
        stats[f"dropped/{reason}"] += 1
        return result([], None)

    if transitions is not None:
        rows = _rows_from_transitions(transitions, final, config, stats)
    else:
        step = (
            step_rewards_per_turn(calls, rewards)
            if config.credit == "per_step"
            else [0.0] * len(calls)
        )
        finals = agent_final_rewards(calls, rewards, final)
        credit = assign_credit(finals, step, air_rewards_per_turn(calls, spans, config), config)
        turns = _turns(calls, config, stats)
        rows = (
            _merge_turns(turns, stats) if config.mode == "trajectory" else list(map(_row_of, turns))
        )
        for row in rows:
            row.reward = credit[row.first_turn]
    kept = _cap(_fit_lengths(rows, config, stats), config, stats)
    if not kept:
        stats["dropped/no_trainable_calls"] += 1
    return result(kept, final)


def _transition(row: _Row) -> Transition:
    meta = {"turns": row.turns, **row.metadata}
    if row.call_ids:
        meta["call_ids"] = row.call_ids
    return Transition(
        prompt_token_ids=row.prompt,
        response_token_ids=row.response,
        response_logprobs=row.logprobs,
        response_mask=row.mask,
        reward=row.reward,
        agent_name=row.agent_name,
        model=row.model,
        metadata=meta,
    )


# ---- batches ----------------------------------------------------------------------------------


@dataclass
class TrainingBatch:
    """Padded training rows as plain lists (``to_torch`` makes tensors).

    Prompts are left-padded, responses right-padded, with ``pad_token_id``.
    ``attention_mask`` and ``position_ids`` cover ``prompt + response``; positions count
    real tokens from 0 (padding gets 0), as verl computes them.
    """

    pad_token_id: int
    prompt_length: int
    response_length: int
    prompt_ids: list[list[int]] = field(default_factory=list)
    prompt_mask: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    response_mask: list[list[int]] = field(default_factory=list)
    response_logprobs: list[list[float]] = field(default_factory=list)
    attention_mask: list[list[int]] = field(default_factory=list)
    position_ids: list[list[int]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    token_level_rewards: list[list[float]] = field(default_factory=list)
    group_ids: list[str] = field(default_factory=list)
    rollout_ids: list[str] = field(default_factory=list)
    agent_names: list[str | None] = field(default_factory=list)
    models: list[str | None] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rewards)

    def select(self, rows: Sequence[int]) -> TrainingBatch:
        """A batch of these rows only, in this order, with the same widths and ``stats``
        (per-row lists left empty in this batch stay empty)."""
        per_row = [
            f.name
            for f in fields(self)
            if isinstance(getattr(self, f.name), list) and len(getattr(self, f.name)) == len(self)
        ]
        picked = {name: [getattr(self, name)[i] for i in rows] for name in per_row}
        return replace(self, **picked, stats=dict(self.stats))

    def to_torch(self, device: Any = None) -> dict[str, Any]:
        """The tensor fields as torch tensors (needs torch), plus ``input_ids`` =
        prompt + response. Ids, masks and positions are ``long``; the rest ``float32``."""
        import torch

        n, p, r = len(self), self.prompt_length, self.response_length

        def tensor(rows: list[Any], width: int, dtype: Any) -> Any:
            return torch.tensor(rows, dtype=dtype, device=device).reshape(n, width)

        long, flt = torch.long, torch.float32
        out = {
            "prompt_ids": tensor(self.prompt_ids, p, long),
            "prompt_mask": tensor(self.prompt_mask, p, long),
            "response_ids": tensor(self.response_ids, r, long),
            "response_mask": tensor(self.response_mask, r, long),
            "response_logprobs": tensor(self.response_logprobs, r, flt),
            "attention_mask": tensor(self.attention_mask, p + r, long),
            "position_ids": tensor(self.position_ids, p + r, long),
            "token_level_rewards": tensor(self.token_level_rewards, r, flt),
            "rewards": torch.tensor(self.rewards, dtype=flt, device=device),
        }
        out["input_ids"] = torch.cat([out["prompt_ids"], out["response_ids"]], dim=-1)
        return out


def collate(
    trajectories: Sequence[Trajectory], config: TrajectoryConfig | None = None
) -> TrainingBatch:
    """Pad every transition of every trajectory into one batch.

    Widths are the longest prompt/response in the batch, or the configured maximum lengths
    when ``pad_to_max_lengths`` is set. ``stats`` sums the trajectories' counts and adds
    ``rows``, ``rollouts`` and ``rollouts_with_rows``.
    """
    config = config or TrajectoryConfig()
    pad = config.pad_token_id
    rows = [(traj, tr) for traj in trajectories for tr in traj.transitions]
    p_len = max((len(tr.prompt_token_ids) for _, tr in rows), default=0)
    r_len = max((len(tr.response_token_ids) for _, tr in rows), default=0)
    if config.pad_to_max_lengths:
        p_len = max(p_len, config.max_prompt_length or 0)
        r_len = max(r_len, config.max_response_length or 0)

    stats: Counter[str] = Counter()
    for traj in trajectories:
        stats.update(traj.stats or {"merge_failures": traj.merge_failures})
    batch = TrainingBatch(pad_token_id=pad, prompt_length=p_len, response_length=r_len)
    for traj, tr in rows:
        prompt, response = tr.prompt_token_ids, tr.response_token_ids
        mask = tr.response_mask if tr.response_mask is not None else [1] * len(response)
        logprobs = tr.response_logprobs or [0.0] * len(response)
        if len(mask) != len(response) or len(logprobs) != len(response):
            raise ValueError(f"rollout {traj.rollout_id}: response mask/logprobs length mismatch")
        reward = tr.reward if tr.reward is not None else traj.reward
        if reward is None:
            raise ValueError(f"rollout {traj.rollout_id}: a transition has no reward")
        p_pad, r_pad = p_len - len(prompt), r_len - len(response)
        attention = [0] * p_pad + [1] * (len(prompt) + len(response)) + [0] * r_pad
        token_rewards = [0.0] * r_len
        if 1 in mask:
            token_rewards[len(mask) - 1 - mask[::-1].index(1)] = float(reward)
        batch.prompt_ids.append([pad] * p_pad + list(prompt))
        batch.prompt_mask.append(attention[:p_len])
        batch.response_ids.append(list(response) + [pad] * r_pad)
        batch.response_mask.append(list(mask) + [0] * r_pad)
        batch.response_logprobs.append(list(logprobs) + [0.0] * r_pad)
        batch.attention_mask.append(attention)
        batch.position_ids.append(_positions(attention))
        batch.rewards.append(float(reward))
        batch.token_level_rewards.append(token_rewards)
        batch.group_ids.append(traj.task_id)
        batch.rollout_ids.append(traj.rollout_id)
        batch.agent_names.append(tr.agent_name)
        batch.models.append(tr.model)
    stats["rows"] = len(rows)
    stats["rollouts"] = len(trajectories)
    stats["rollouts_with_rows"] = sum(1 for t in trajectories if t.transitions)
    batch.stats = dict(stats)
    return batch


def _positions(attention: list[int]) -> list[int]:
    out, seen = [], 0
    for a in attention:
        seen += a
        out.append(max(seen - 1, 0))
    return out


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
