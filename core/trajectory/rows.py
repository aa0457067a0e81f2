"""Calls become rows: the turns to train on, merged per agent, cut to the length limits
and capped per rollout."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from voltrl.errors import MissingTokenIdsError
from voltrl.trajectory.config import TrajectoryConfig
from voltrl.types import ABANDONED, LLMCall, Transition


@dataclass
class Row:
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
    versions: list[int | None] = field(default_factory=list)
    """Each call's resources version (which weights sampled it), in ``call_ids``' order."""
    reward: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def add(self, tokens: Sequence[int], generated: bool, logprobs: Sequence[float] | None) -> None:
        """Append response tokens, trained on (mask 1) when ``generated``."""
        self.response += tokens
        self.mask += [int(generated)] * len(tokens)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)

    def transition(self) -> Transition:
        """The finished row."""
        meta = {"turns": self.turns, **self.metadata}
        if self.call_ids:
            meta["call_ids"] = self.call_ids
            meta["resources_versions"] = self.versions
        return Transition(
            prompt_token_ids=self.prompt,
            response_token_ids=self.response,
            response_logprobs=self.logprobs,
            response_mask=self.mask,
            reward=self.reward,
            agent_name=self.agent_name,
            model=self.model,
            metadata=meta,
        )


@dataclass
class Turn:
    """A call to train on, its token ids resolved."""

    index: int
    call: LLMCall
    prompt: list[int]
    response: list[int]
    logprobs: list[float] | None
    retokenized: bool = False


def turns(
    calls: Sequence[LLMCall],
    finals: Sequence[float | None],
    config: TrajectoryConfig,
    stats: Counter[str],
) -> list[Turn]:
    """The calls to train on, with token ids resolved per ``missing_token_ids``. A call
    outside ``agent_filter``, or with no final reward (``finals[i]`` None: no reward of the
    rollout and none addressed to its agent), is left out and counted. The calls selected are
    counted as ``calls`` (before the length limits and the cap), those whose reply was cut off
    at its token cap or the context's end (``finish_reason`` ``"length"``) also as
    ``stopped/length``."""
    out = []
    for i, call in enumerate(calls):
        if not config.trains_agent(call.agent_name):
            stats["dropped/agent_filter"] += 1
            continue
        if finals[i] is None:
            stats["dropped/no_agent_reward"] += 1
            continue
        if call.finish_reason == ABANDONED:  # cut off mid-way: not what the policy would say
            stats["dropped/abandoned_call"] += 1
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
        stats["calls"] += 1
        if call.finish_reason == "length":
            stats["stopped/length"] += 1
        out.append(Turn(i, call, list(prompt), list(response), logprobs, retokenized))
    return out


def row_of(turn: Turn) -> Row:
    """A row of one turn: its prompt, its generated tokens."""
    call = turn.call
    row = Row(turn.prompt, agent_name=call.agent_name, model=call.model, first_turn=turn.index)
    _extend(row, turn, [])
    return row


def _extend(row: Row, turn: Turn, context: list[int]) -> None:
    row.add(context, False, None)
    row.add(turn.response, True, turn.logprobs)
    row.turns.append(turn.index)
    row.call_ids.append(turn.call.call_id)
    row.versions.append(turn.call.resources_version)
    if turn.retokenized:
        row.metadata["retokenized"] = True


def merge_turns(turns: Sequence[Turn], stats: Counter[str]) -> list[Row]:
    """Trajectory mode: each turn extends its agent's open row when its prompt starts with
    that row's prompt + response (counted as ``merged``); otherwise it opens a new row (one
    ``merge_failures``; none when another model sampled it). The merge rate is
    ``merged / (merged + merge_failures)``."""
    rows: list[Row] = []
    open_rows: dict[str | None, Row] = {}
    for turn in turns:
        row = open_rows.get(turn.call.agent_name)
        if row is not None and row.model == turn.call.model:
            full = row.prompt + row.response
            if turn.prompt[: len(full)] == full:
                _extend(row, turn, turn.prompt[len(full) :])
                stats["merged"] += 1
                continue
            stats["merge_failures"] += 1
        row = open_rows[turn.call.agent_name] = row_of(turn)
        rows.append(row)
    return rows


def rows_from_transitions(
    transitions: Sequence[Transition],
    credit: Sequence[float | None],
    config: TrajectoryConfig,
    stats: Counter[str],
) -> list[Row]:
    """Explicit transitions as-is; one without a reward gets ``credit`` of its position (and
    is left out, counted, when that is None: no final reward for its agent)."""
    rows = []
    for i, tr in enumerate(transitions):
        if not config.trains_agent(tr.agent_name):
            stats["dropped/agent_filter"] += 1
            continue
        reward = tr.reward if tr.reward is not None else credit[i]
        if reward is None:
            stats["dropped/no_agent_reward"] += 1
            continue
        response, mask, logprobs = tr.response_token_ids, tr.response_mask, tr.response_logprobs
        if mask is not None and len(mask) != len(response):
            raise ValueError(f"transition {i}: response_mask and response_token_ids differ")
        if logprobs is None or len(logprobs) != len(response):
            stats["missing_logprobs"] += 1
            logprobs = None
        row = Row(
            prompt=list(tr.prompt_token_ids), agent_name=tr.agent_name, model=tr.model, first_turn=i
        )
        row.add(response, True, logprobs)
        row.mask = list(mask) if mask is not None else row.mask
        row.turns, row.reward = [i], reward
        row.metadata = {**tr.metadata, "explicit": True}
        rows.append(row)
    return rows


def fit_lengths(rows: list[Row], config: TrajectoryConfig, stats: Counter[str]) -> list[Row]:
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


def cap(rows: list[Row], config: TrajectoryConfig, stats: Counter[str]) -> list[Row]:
    """``max_transitions_per_rollout`` applied (see :func:`cap_indices`)."""
    keep = cap_indices(len(rows), config.max_transitions_per_rollout)
    stats["dropped/over_cap"] += len(rows) - len(keep)
    return [rows[i] for i in keep]
