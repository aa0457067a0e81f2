"""What a rollout page shows first: the outcome the rollout recorded, and its calls as one
conversation. Plain data for the templates: no HTML here.

**The outcome** is what the agent recorded about how the rollout ended, whatever the agent:
its events (:func:`voltrl.emit_event` makes a zero-length span, e.g. tau2's ``episode`` with
its termination and score, werewolf's ``game`` with its winner) and its rewards by name, with
what each was credited to (the whole rollout, or the agents a regex matches: each werewolf
side's outcome). A reward emitted for no agent is also marked in the conversation, on the call
it follows, where per-step credit puts it (:func:`reward_marks`: a werewolf penalty on the
answer that earned it).

**The conversation** is every call's request and response, each message shown once: a call
whose messages continue an earlier call's (its request and response, or its request alone)
shows only the messages that are new, so a chat of 30 turns reads as one thread, not 30
copies of a growing history. A message longer than its share of the page's text budget is
clipped in the middle (its start and its end stay: the end of a re-rendered history is the
latest turn); the whole request is one click away (fetched when opened). A page shows
:data:`CALLS_PER_PAGE` calls: whatever its number of calls, a rollout page stays under a
megabyte.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from voltrl.trajectory.credit import owner_turn
from voltrl.types import LLMCall, Reward

CALLS_PER_PAGE = 100
"""Calls one rollout page shows (a game of more is read page by page)."""
TEXT_BUDGET = 100_000
"""Characters of message text a rollout page shows inline, shared by its calls."""
CLIP_MIN, CLIP_MAX = 240, 6_000
"""The fewest and most characters one message shows inline, whatever the number of calls."""
EVENTS_SHOWN = 20
"""Events listed in the outcome (the rest are under the spans)."""


def _as_text(value: Any, indent: int | None = None) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str, indent=indent)


def shown_value(value: Any, limit: int = 160) -> str:
    """An attribute's value as one short line (mappings and lists as compact JSON)."""
    text = _as_text(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def whole_value(value: Any, limit: int = 160) -> str | None:
    """An attribute's value in full (mappings and lists as indented JSON) when
    :func:`shown_value` cuts it short; None when its line shows all of it."""
    return _as_text(value, indent=1) if len(_as_text(value)) > limit else None


@dataclass
class RewardLine:
    """The rewards of one name: how many, the last value and their sum, credited to whom."""

    name: str
    agents: str | None
    count: int
    last: float
    total: float
    source: str


def reward_lines(rewards: Sequence[Reward]) -> list[RewardLine]:
    """``rewards`` grouped by name and the agents they are credited to, first seen first."""
    lines: dict[tuple[str, str | None], RewardLine] = {}
    for r in rewards:
        key = (r.name, r.agents)
        line = lines.get(key)
        if line is None:
            lines[key] = RewardLine(r.name, r.agents, 1, r.value, r.value, r.source)
        else:
            line.count += 1
            line.last = r.value
            line.total += r.value
    return list(lines.values())


def reward_marks(calls: Sequence[LLMCall], rewards: Sequence[Reward]) -> list[list[Reward]]:
    """For each of ``calls``, the rewards that follow it: each reward emitted for no agent
    (not the rollout's returned one) goes to the call of its attempt that ended last before it,
    the call per-step credit gives it to (:func:`voltrl.trajectory.credit.owner_turn`)."""
    marks: list[list[Reward]] = [[] for _ in calls]
    by_attempt: dict[str, tuple[list[int], list[LLMCall]]] = {}
    for i, call in enumerate(calls):
        indices, own = by_attempt.setdefault(call.attempt_id, ([], []))
        indices.append(i)
        own.append(call)
    for reward in rewards:
        indices, own = by_attempt.get(reward.attempt_id, ([], []))
        if own and reward.agents is None and reward.source != "return":
            marks[indices[owner_turn(own, reward.timestamp)]].append(reward)
    return marks


# ---- the conversation ---------------------------------------------------------------------------
@dataclass
class Message:
    """A message as the page shows it: its role, name, text (clipped), tool calls."""

    role: str
    text: str
    clipped: int = 0
    """Characters left out of the middle of ``text`` (0: all of it)."""
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[str] = field(default_factory=list)
    """Each tool call as ``name(arguments)``."""


@dataclass
class CallHead:
    """What the page says of a call besides its messages (no token ids: a page of hundreds
    of calls is kept small, in memory too)."""

    call_id: str
    attempt_id: str
    sequence_id: int | None
    agent_name: str | None
    model: str | None
    finish_reason: str | None
    latency_s: float | None
    resources_version: int | None
    prompt_tokens: int | None
    """How many prompt token ids were recorded (None: the backend returned none)."""
    response_tokens: int | None

    @classmethod
    def of(cls, call: LLMCall) -> CallHead:
        """The head of ``call``."""
        ids = call.has_token_ids
        return cls(
            call.call_id,
            call.attempt_id,
            call.sequence_id,
            call.agent_name,
            call.model,
            call.finish_reason,
            call.latency_s,
            call.resources_version,
            len(call.prompt_token_ids or []) if ids else None,
            len(call.response_token_ids or []) if ids else None,
        )


@dataclass
class Turn:
    """One call in the conversation: the messages new since the call it continues, its
    response, and the tools it was offered when they changed."""

    call: CallHead
    new: list[Message]
    earlier: int
    """Messages of its request not shown again (they are in an earlier call's turn)."""
    continues: int | None
    """The sequence id of the call whose messages it continues, if any."""
    response: Message
    reasoning: str | None
    tools: list[str] | None
    """The names of the tools offered, when they differ from the agent's previous call."""
    rewards: list[Reward] = field(default_factory=list)
    """The rewards that follow the call (:func:`reward_marks`)."""


def clip_length(calls: int) -> int:
    """How many characters one message shows inline in a conversation of ``calls`` calls
    (shown :data:`CALLS_PER_PAGE` at a time)."""
    return max(CLIP_MIN, min(CLIP_MAX, TEXT_BUDGET // max(1, min(calls, CALLS_PER_PAGE))))


def clip(text: str, limit: int | None) -> tuple[str, int]:
    """``text`` with its middle left out when longer than ``limit`` (a quarter of the kept
    characters from the start, the rest from the end), and how many were left out."""
    if limit is None or len(text) <= limit:
        return text, 0
    head = limit // 4
    tail = limit - head
    return f"{text[:head]}\n…\n{text[-tail:]}", len(text) - head - tail


def text_of(content: Any) -> str:
    """A message's content as text: strings as they are, text parts joined, anything else
    as indented JSON; no content is empty text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and "text" in p for p in content):
        return "\n".join(str(p["text"]) for p in content)
    return json.dumps(content, indent=2, ensure_ascii=False, default=str)


def tool_calls(message: dict[str, Any]) -> list[str]:
    """A message's tool calls as ``name(arguments)``."""
    out = []
    for tc in message.get("tool_calls") or []:
        function = tc.get("function") or {} if isinstance(tc, dict) else {}
        out.append(f"{function.get('name', '?')}({function.get('arguments', '')})")
    return out


def message(m: dict[str, Any], limit: int | None) -> Message:
    """A request or response message as the page shows it, its text clipped to ``limit``
    characters (None: all of it)."""
    text, left_out = clip(text_of(m.get("content")), limit)
    return Message(
        role=str(m.get("role") or "?"),
        text=text,
        clipped=left_out,
        name=m.get("name"),
        tool_call_id=m.get("tool_call_id"),
        tool_calls=tool_calls(m),
    )


def response_message(call: LLMCall) -> dict[str, Any]:
    """The assistant message the call answered with (of its choice)."""
    choices = call.response.get("choices") or []
    choice = next((c for c in choices if c.get("index") == call.choice_index), None)
    choice = choice or (choices[0] if choices else {})
    return choice.get("message") or {}


def _key(m: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two messages the same message: a response sent back in a later request
    matches it (its role, text and tool calls; fields a client drops do not count)."""
    return (m.get("role") or "assistant", text_of(m.get("content")), tuple(tool_calls(m)))


def _chain(messages: Sequence[dict[str, Any]]) -> list[int]:
    """The hash of each prefix of ``messages`` (element ``k``: of the first ``k + 1``)."""
    out, h = [], 0
    for m in messages:
        h = hash((h, _key(m)))
        out.append(h)
    return out


def thread(calls: Sequence[LLMCall]) -> list[Turn]:
    """``calls`` (in order) as one conversation: each call's messages that no earlier call
    of the same attempt showed, its response, clipped to the page's text budget."""
    limit = clip_length(len(calls))
    seen: dict[tuple[str, int], int | None] = {}  # (attempt, hash of messages) -> a call's seq
    tools_of: dict[tuple[str, str | None], list[str]] = {}
    turns = []
    for call in calls:
        messages = [m for m in call.request.get("messages") or [] if isinstance(m, dict)]
        chain = _chain(messages)
        earlier, continues = 0, None
        for k in range(len(chain) - 1, -1, -1):
            if (call.attempt_id, chain[k]) in seen:
                earlier, continues = k + 1, seen[(call.attempt_id, chain[k])]
                break
        answer = response_message(call)
        for h in chain:
            seen.setdefault((call.attempt_id, h), call.sequence_id)
        whole = hash((chain[-1] if chain else 0, _key({"role": "assistant", **answer})))
        seen[(call.attempt_id, whole)] = call.sequence_id
        tools = [
            str((t.get("function") or t).get("name", "?"))
            for t in call.request.get("tools") or []
            if isinstance(t, dict)
        ]
        agent = (call.attempt_id, call.agent_name)
        offered = tools if tools and tools_of.get(agent) != tools else None
        tools_of[agent] = tools
        reasoning = answer.get("reasoning_content")
        turns.append(
            Turn(
                call=CallHead.of(call),
                new=[message(m, limit) for m in messages[earlier:]],
                earlier=earlier,
                continues=continues,
                response=message({"role": "assistant", **answer}, max(limit, CLIP_MIN * 4)),
                reasoning=clip(str(reasoning), limit)[0] if reasoning else None,
                tools=offered,
            )
        )
    return turns
