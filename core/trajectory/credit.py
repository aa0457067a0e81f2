"""Credit assignment: each turn's reward from the final reward, step rewards and AIR.

For turn ``t`` of ``T`` with final reward ``R_t`` (the rollout's, or its agent's own),
step reward ``r_t`` and AIR reward ``a_t`` (``docs/trajectory.md``)::

    final        c_t = R_t + a_t
    discounted   c_t = gamma**(T-1-t) * R_t + a_t
    per_step     G_t = r_t + a_t + gamma * G_{t+1},  G_T = 0;  c_t = G_t (+ R_t)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from voltrl.trajectory.config import TrajectoryConfig
from voltrl.types import LLMCall, Reward, Rollout, Span

TOOL_CALL_ID_ATTRIBUTES = ("gen_ai.tool.call.id", "tool_call_id", "tool.call_id")
TOOL_ATTRIBUTES = (*TOOL_CALL_ID_ATTRIBUTES, "gen_ai.tool.name", "tool.name", "tool_name")


# ---- final rewards ----------------------------------------------------------------------------


def final_reward(
    rollout: Rollout, rewards: Sequence[Reward], config: TrajectoryConfig
) -> tuple[float | None, str | None]:
    """The rollout's final reward, or the reason the rollout is dropped. ``(None, None)``:
    no reward of the whole rollout, but rewards for some agents, which train their calls."""
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
    if returned:
        return returned[-1].value, None
    if any(r.agents is not None for r in rewards):
        return None, None
    return None, "no_reward"


def agent_final_rewards(
    agent_names: Sequence[str | None], rewards: Sequence[Reward], final: float | None
) -> list[float | None]:
    """The final reward of each agent name in turn: the last reward addressed to it (metadata
    ``agents``, a regex fully matching the name), else the rollout's ``final`` (None when the
    rollout has none: that call has no reward at all)."""
    addressed = [(re.compile(r.agents), r.value) for r in rewards if r.agents is not None]
    out = []
    for name in agent_names:
        matching = [v for pattern, v in addressed if pattern.fullmatch(name or "")]
        out.append(matching[-1] if matching else final)
    return out


def assign_credit(
    final: float | Sequence[float],
    step_rewards: Sequence[float],
    air_rewards: Sequence[float],
    config: TrajectoryConfig,
) -> list[float]:
    """Each turn's credit from the final reward (one for all turns, or one per turn when
    agents have finals of their own), its own step rewards and its AIR rewards (lists with
    one entry per turn), as the module docstring writes it."""
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


# ---- step rewards ---------------------------------------------------------------------------


def _end(call: LLMCall) -> float:
    return call.ended_at if call.ended_at is not None else call.started_at


def owner_turn(calls: Sequence[LLMCall], timestamp: float) -> int:
    """The turn a timestamped event belongs to: the last call (latest end, then latest turn)
    that ended at or before ``timestamp``; the first call when none had."""
    done = [(_end(c), i) for i, c in enumerate(calls) if _end(c) <= timestamp]
    return max(done)[1] if done else 0


def step_rewards_per_turn(calls: Sequence[LLMCall], rewards: Sequence[Reward]) -> list[float]:
    """Sum of the reward records owned by each turn (records with source ``"return"`` are the
    final reward and are skipped, as are rewards addressed to agents)."""
    out = [0.0] * len(calls)
    for rw in rewards:
        if rw.source != "return" and rw.agents is None and calls:
            out[owner_turn(calls, rw.timestamp)] += rw.value
    return out


# ---- automatic intermediate rewards (tool success / failure) ----------------------------------


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
