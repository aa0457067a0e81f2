"""The token-drift audit: are the recorded ids what the model's chat template makes of each call's
messages, does each call continue its agent's previous one token for token, and is every trained
token a sampled one (``docs/fidelity.md``).

:func:`audit_calls` audits one rollout attempt's calls (a :class:`RolloutAudit`);
:func:`summarize` sums many into a run's :class:`AuditSummary`. Each call gets two checks, each
``identical``, ``diverges`` (with the first diverging position and the tokens around it) or
``not_checkable`` with its reason (:data:`REASONS`), never left out:

- the **template** check renders ``request["messages"]`` (and ``tools``) as the engine does
  (:func:`voltrl.models.chat.render_chat`, then ``encode(text, add_special_tokens=False)``) and
  compares that with the recorded ``prompt_token_ids``;
- the **continuation** check compares the call's prompt with its agent's previous call's
  prompt + response (same attempt, calls ordered as the builder orders them, the same model):
  exactly the condition under which trajectory mode merges the call into that row
  (:func:`voltrl.trajectory.rows.merge_turns`); a divergence is a row split by drift.

**Trained-token drift** is a row the builder trains whose tokens are not the sampled ones: a
call recorded without token ids and re-tokenized (``missing_token_ids="retokenize"``), or an
explicit :class:`~voltrl.types.Transition` whose generated tokens are not sampled responses of
the attempt's calls (:func:`retokenized_drift`, :func:`transition_drift`). The builder reports
it per ``TrajectoryConfig.audit``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from voltrl.models.chat import ChatError, render_chat
from voltrl.trajectory.config import TrajectoryConfig
from voltrl.types import ABANDONED, LLMCall, Transition

CONTEXT = 4
"""Tokens shown on each side of a divergence."""

Outcome = Literal["identical", "diverges", "not_checkable"]

REASONS: dict[str, str] = {
    "no_token_ids": "no token ids recorded",
    "no_messages": "not a chat call (no messages: a /completions call)",
    "no_tokenizer": "no tokenizer",
    "no_chat_template": "the tokenizer has no chat template",
    "template_error": "the chat template raised",
    "first_call": "first call of its agent in the attempt (nothing to continue)",
    "previous_no_token_ids": "the agent's previous call has no token ids",
    "other_model": "the agent's previous call was sampled by another model (a new row)",
}
"""Why a check could not be made, by the key counted (``"<check>/<key>"``) in
:attr:`AuditCounts.reasons`."""


@dataclass(frozen=True)
class Divergence:
    """Where two token sequences first differ: ``position`` in both; ``before`` the ids they
    share just before it; ``expected`` and ``recorded`` each side's ids from it on (a few of
    each, :data:`CONTEXT`; empty where that side ends there). Texts are decoded with the
    tokenizer, None without one."""

    position: int
    expected_length: int
    recorded_length: int
    before: tuple[int, ...]
    expected: tuple[int, ...]
    recorded: tuple[int, ...]
    before_text: str | None = None
    expected_text: str | None = None
    recorded_text: str | None = None

    def marked(self) -> str:
        """The context with the divergence marked: ``…before⟦expected ≠ recorded⟧``."""
        before = self.before_text if self.before_text is not None else _ids(self.before)
        expected = self.expected_text if self.expected_text is not None else _ids(self.expected)
        recorded = self.recorded_text if self.recorded_text is not None else _ids(self.recorded)
        return f"{before!r} ⟦expected {expected!r} ≠ recorded {recorded!r}⟧"


WHERE: dict[str, str] = {
    "rebuilt": "before the end of the previous prompt: the conversation was rebuilt",
    "answer": "in the previous answer: it came back changed, or not at all",
}
"""Where a continuation diverges (:attr:`Check.detail`): ``rebuilt``, a new conversation or a
history rendered anew (a multi-agent formatter, a workflow node's own prompt), which no
trajectory row could continue; ``answer``, the previous answer sent back otherwise than sampled
(stripped, re-serialised, re-tokenized): drift proper."""


@dataclass(frozen=True)
class Check:
    """One check of one call: its outcome; the divergence, when it diverges (for a
    continuation, where: ``detail`` is a key of :data:`WHERE`); the reason (a key of
    :data:`REASONS`) and maybe a detail (the template's error), when not checkable."""

    outcome: Outcome
    divergence: Divergence | None = None
    reason: str | None = None
    detail: str | None = None

    def describe(self) -> str:
        """One line: ``identical``, ``diverges at 12`` or ``not checkable: no tokenizer``."""
        if self.outcome == "diverges" and self.divergence is not None:
            where = WHERE.get(self.detail or "")
            return f"diverges at {self.divergence.position}" + (f" ({where})" if where else "")
        if self.outcome == "not_checkable":
            why = REASONS.get(self.reason or "", self.reason or "unknown")
            return f"not checkable: {why}" + (f" ({self.detail})" if self.detail else "")
        return "identical"


@dataclass(frozen=True)
class CallAudit:
    """One call's two checks; ``previous_call_id`` is its agent's previous call, the one the
    continuation check compares it with."""

    call_id: str
    rollout_id: str
    attempt_id: str
    sequence_id: int | None
    agent_name: str | None
    template: Check
    continuation: Check
    previous_call_id: str | None = None

    @property
    def outcome(self) -> Outcome:
        """``diverges`` when a check diverges, ``identical`` when none does and one was made,
        else ``not_checkable``."""
        checks = (self.template.outcome, self.continuation.outcome)
        if "diverges" in checks:
            return "diverges"
        return "identical" if "identical" in checks else "not_checkable"


@dataclass(frozen=True)
class TrainedDrift:
    """A row the builder trains whose tokens are not the recorded sampled ones. ``kind``:
    ``retokenized`` (call ``call_id`` had no token ids and was re-tokenized) or
    ``transition`` (explicit transition number ``transition``: its generated tokens from
    ``position`` of its response on are no sampled response; ``call_id`` is the call whose
    response matched longest there, None when the attempt recorded none)."""

    rollout_id: str
    kind: Literal["retokenized", "transition"]
    call_id: str | None
    agent_name: str | None
    transition: int | None = None
    position: int | None = None

    def describe(self) -> str:
        """One line naming the call or transition and the position."""
        if self.kind == "retokenized":
            return (
                f"call {self.call_id} was recorded without token ids and re-tokenized: none of "
                "its trained tokens was sampled"
            )
        near = (
            f"the nearest sampled response is call {self.call_id}'s"
            if self.call_id
            else "the attempt recorded no call"
        )
        return (
            f"explicit transition {self.transition}'s response is not sampled tokens from "
            f"position {self.position} on ({near})"
        )


@dataclass(frozen=True)
class AuditCounts:
    """Counts of calls and checks; ``+`` sums them.

    ``identical``/``diverging``: calls (:attr:`CallAudit.outcome`); ``audited`` is their sum,
    ``not_checkable`` the calls neither check could be made for. ``merged``/``split``:
    continuations identical (the builder merges them) and diverging (it splits them), of which
    ``split_rebuilt`` before the end of the previous prompt (a rebuilt conversation, not
    drift: :data:`WHERE`). ``reasons``: each check not made, as ``"template/<reason>"`` and
    ``"continuation/<reason>"``."""

    calls: int = 0
    identical: int = 0
    diverging: int = 0
    not_checkable: int = 0
    template_identical: int = 0
    template_diverging: int = 0
    merged: int = 0
    split: int = 0
    split_rebuilt: int = 0
    trained_drift: int = 0
    reasons: Mapping[str, int] = field(default_factory=dict)

    @property
    def audited(self) -> int:
        """Calls at least one check could be made for."""
        return self.identical + self.diverging

    @property
    def merge_rate(self) -> float | None:
        """``merged / (merged + split)``; None when no continuation was checkable."""
        done = self.merged + self.split
        return self.merged / done if done else None

    def __add__(self, other: AuditCounts) -> AuditCounts:
        reasons = Counter(self.reasons)
        reasons.update(other.reasons)
        return AuditCounts(
            calls=self.calls + other.calls,
            identical=self.identical + other.identical,
            diverging=self.diverging + other.diverging,
            not_checkable=self.not_checkable + other.not_checkable,
            template_identical=self.template_identical + other.template_identical,
            template_diverging=self.template_diverging + other.template_diverging,
            merged=self.merged + other.merged,
            split=self.split + other.split,
            split_rebuilt=self.split_rebuilt + other.split_rebuilt,
            trained_drift=self.trained_drift + other.trained_drift,
            reasons=dict(sorted(reasons.items())),
        )

    def as_dict(self) -> dict[str, Any]:
        """Every count, ``audited`` and ``merge_rate`` included (for JSON)."""
        return {
            "calls": self.calls,
            "audited": self.audited,
            "identical": self.identical,
            "diverging": self.diverging,
            "not_checkable": self.not_checkable,
            "template_identical": self.template_identical,
            "template_diverging": self.template_diverging,
            "merged": self.merged,
            "split": self.split,
            "split_rebuilt": self.split_rebuilt,
            "merge_rate": self.merge_rate,
            "trained_drift": self.trained_drift,
            "reasons": dict(self.reasons),
        }


def percent(rate: float | None, digits: int = 1) -> str:
    """A rate as the audit prints it: ``-`` for none, and never 100% (or 0%) for a rate that
    is not (one split among 2,320 continuations is ``>99.9%``, not ``100.0%``)."""
    if rate is None:
        return "-"
    text = f"{rate:.{digits}%}"
    floor = 10.0**-digits
    if 0 < rate < 1 and text == f"{100:.{digits}f}%":
        return f">{100 - floor:.{digits}f}%"
    if 0 < rate < 1 and text == f"{0:.{digits}f}%":
        return f"<{floor:.{digits}f}%"
    return text


_COUNTED = {"identical": "identical", "diverges": "diverging", "not_checkable": "not_checkable"}


def counts_of(calls: Iterable[CallAudit], drift: Iterable[TrainedDrift] = ()) -> AuditCounts:
    """The counts of these call audits and trained-drift findings."""
    out: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for call in calls:
        out["calls"] += 1
        out[_COUNTED[call.outcome]] += 1
        for name, check in (("template", call.template), ("continuation", call.continuation)):
            if check.outcome == "not_checkable":
                reasons[f"{name}/{check.reason}"] += 1
        out["template_identical"] += call.template.outcome == "identical"
        out["template_diverging"] += call.template.outcome == "diverges"
        out["merged"] += call.continuation.outcome == "identical"
        out["split"] += call.continuation.outcome == "diverges"
        out["split_rebuilt"] += call.continuation.detail == "rebuilt"
    found = sum(1 for _ in drift)
    return AuditCounts(**out, trained_drift=found, reasons=dict(sorted(reasons.items())))


@dataclass(frozen=True)
class RolloutAudit:
    """One rollout attempt's audit: each call's checks, in the builder's order, and the
    trained-token drift of the rows it would train."""

    rollout_id: str
    attempt_id: str | None
    calls: tuple[CallAudit, ...]
    trained_drift: tuple[TrainedDrift, ...] = ()

    @property
    def counts(self) -> AuditCounts:
        """The rollout's counts."""
        return counts_of(self.calls, self.trained_drift)

    def by_agent(self) -> dict[str, AuditCounts]:
        """The counts per agent name (``""`` for calls without one)."""
        names = dict.fromkeys(c.agent_name or "" for c in self.calls)
        names.update(dict.fromkeys(d.agent_name or "" for d in self.trained_drift))
        return {
            name: counts_of(
                [c for c in self.calls if (c.agent_name or "") == name],
                [d for d in self.trained_drift if (d.agent_name or "") == name],
            )
            for name in names
        }


@dataclass(frozen=True)
class AuditSummary:
    """Many rollouts' audits summed: the totals, per agent, the diverging calls and every
    trained-token drift, in the rollouts' order."""

    rollouts: int
    counts: AuditCounts
    agents: dict[str, AuditCounts]
    diverging: tuple[CallAudit, ...]
    trained_drift: tuple[TrainedDrift, ...]


def summarize(audits: Iterable[RolloutAudit]) -> AuditSummary:
    """Sum rollout audits into a run's summary."""
    total, agents, n = AuditCounts(), dict[str, AuditCounts](), 0
    diverging: list[CallAudit] = []
    drift: list[TrainedDrift] = []
    for audit in audits:
        n += 1
        total = total + audit.counts
        for name, counts in audit.by_agent().items():
            agents[name] = agents.get(name, AuditCounts()) + counts
        diverging += [c for c in audit.calls if c.outcome == "diverges"]
        drift += audit.trained_drift
    return AuditSummary(n, total, dict(sorted(agents.items())), tuple(diverging), tuple(drift))


# ---- the checks ---------------------------------------------------------------------------------
def ordered(calls: Iterable[LLMCall]) -> list[LLMCall]:
    """Calls in the builder's order: by ``sequence_id`` (calls without one last), then start."""
    return sorted(calls, key=lambda c: (c.sequence_id is None, c.sequence_id or 0, c.started_at))


def previous_calls(calls: Sequence[LLMCall]) -> list[LLMCall | None]:
    """For each call of ``calls`` (in the builder's order), its agent's previous call in the
    same attempt, as trajectory mode's merge sees it: calls the gateway cut off (finish reason
    ``abandoned``) are never trained, so never continued."""
    last: dict[tuple[str, str | None], LLMCall] = {}
    out: list[LLMCall | None] = []
    for call in calls:
        key = (call.attempt_id, call.agent_name)
        out.append(last.get(key))
        if call.finish_reason != ABANDONED:
            last[key] = call
    return out


def audit_call(
    call: LLMCall, previous: LLMCall | None, tokenizer: Any | None, template: Check | None = None
) -> CallAudit:
    """Both checks of one call, ``previous`` being its agent's previous call (None for the
    first; see :func:`previous_calls`); ``template``: its template check, when made already."""
    return CallAudit(
        call_id=call.call_id,
        rollout_id=call.rollout_id,
        attempt_id=call.attempt_id,
        sequence_id=call.sequence_id,
        agent_name=call.agent_name,
        template=template or template_check(call, tokenizer),
        continuation=continuation_check(call, previous, tokenizer),
        previous_call_id=previous.call_id if previous is not None else None,
    )


def template_check(call: LLMCall, tokenizer: Any | None) -> Check:
    """Whether the call's prompt ids are what the engine makes of its request: the chat
    template over its ``messages`` and ``tools`` with the request's ``add_generation_prompt``,
    ``continue_final_message`` and ``chat_template_kwargs``, encoded without special tokens."""
    return template_checks([call], tokenizer)[0]


def template_checks(calls: Sequence[LLMCall], tokenizer: Any | None) -> list[Check]:
    """:func:`template_check` of each call, the prompts encoded in one batch (which a fast
    tokenizer may spread over its threads); encoding is most of the audit's time."""
    rendered = [_rendered(call, tokenizer) for call in calls]
    texts = [r for r in rendered if isinstance(r, str)]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    return [
        r
        if isinstance(r, Check)
        else _compare(next(encoded), c.prompt_token_ids or [], tokenizer, whole=True)
        for c, r in zip(calls, rendered, strict=True)
    ]


def _rendered(call: LLMCall, tokenizer: Any | None) -> str | Check:
    """The text the engine renders of the call's request, or the check that cannot be made."""
    body = call.request
    messages = body.get("messages")
    if call.prompt_token_ids is None:
        return Check("not_checkable", reason="no_token_ids")
    if not isinstance(messages, list) or not messages:
        return Check("not_checkable", reason="no_messages")
    if tokenizer is None:
        return Check("not_checkable", reason="no_tokenizer")
    if not getattr(tokenizer, "chat_template", None):
        return Check("not_checkable", reason="no_chat_template")
    kwargs = body.get("chat_template_kwargs") or {}
    try:
        if not isinstance(kwargs, dict):
            raise ChatError("chat_template_kwargs is not an object")
        return render_chat(
            tokenizer,
            messages,
            body.get("tools"),
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
            template_kwargs=kwargs,
        )
    except ChatError as e:
        return Check("not_checkable", reason="template_error", detail=str(e))


def continuation_check(call: LLMCall, previous: LLMCall | None, tokenizer: Any | None) -> Check:
    """Whether the call's prompt starts with ``previous``'s prompt + response, the condition
    under which trajectory mode merges it into that call's row (same model too)."""
    if call.prompt_token_ids is None:
        return Check("not_checkable", reason="no_token_ids")
    if previous is None:
        return Check("not_checkable", reason="first_call")
    if previous.prompt_token_ids is None or previous.response_token_ids is None:
        return Check("not_checkable", reason="previous_no_token_ids", detail=previous.call_id)
    if previous.model != call.model:
        return Check(
            "not_checkable", reason="other_model", detail=f"{previous.model} → {call.model}"
        )
    expected = previous.prompt_token_ids + previous.response_token_ids
    check = _compare(expected, call.prompt_token_ids, tokenizer, whole=False)
    if check.divergence is None:
        return check
    rebuilt = check.divergence.position < len(previous.prompt_token_ids)
    return dataclasses.replace(check, detail="rebuilt" if rebuilt else "answer")


def _compare(
    expected: Sequence[int], recorded: Sequence[int], tokenizer: Any | None, *, whole: bool
) -> Check:
    """``identical`` when ``recorded`` is ``expected`` (``whole``) or starts with it."""
    n = len(expected)
    if (list(recorded) == list(expected)) if whole else (list(recorded[:n]) == list(expected)):
        return Check("identical")
    at = next(
        (i for i, (a, b) in enumerate(zip(expected, recorded, strict=False)) if a != b),
        min(n, len(recorded)),
    )
    return Check("diverges", divergence=divergence(expected, recorded, at, tokenizer))


def divergence(
    expected: Sequence[int], recorded: Sequence[int], at: int, tokenizer: Any | None
) -> Divergence:
    """The :class:`Divergence` of two sequences that first differ at ``at``."""
    before = tuple(recorded[max(0, at - CONTEXT) : at])
    theirs, ours = tuple(expected[at : at + CONTEXT]), tuple(recorded[at : at + CONTEXT])

    def text(ids: tuple[int, ...]) -> str | None:
        if tokenizer is None:
            return None
        try:
            return str(tokenizer.decode(list(ids)))
        except (TypeError, ValueError, OverflowError):  # an id outside its vocabulary
            return None

    return Divergence(
        position=at,
        expected_length=len(expected),
        recorded_length=len(recorded),
        before=before,
        expected=theirs,
        recorded=ours,
        before_text=text(before),
        expected_text=text(theirs),
        recorded_text=text(ours),
    )


# ---- trained-token drift ------------------------------------------------------------------------
def retokenized_drift(call: LLMCall) -> TrainedDrift:
    """A call trained from re-tokenized text: its trained tokens were never sampled."""
    return TrainedDrift(call.rollout_id, "retokenized", call.call_id, call.agent_name)


def transition_drift(
    transition: Transition, index: int, calls: Sequence[LLMCall], rollout_id: str
) -> TrainedDrift | None:
    """None when every generated token of the explicit ``transition`` (mask 1, or all of its
    response without a mask) lies in a run of them made of sampled responses of ``calls``,
    whole and in any order (a merged row's generated turns, context tokens between them);
    else where the first token that is not one is."""
    response = transition.response_token_ids
    mask = transition.response_mask or [1] * len(response)
    sampled = [c for c in calls if c.response_token_ids]
    start = 0
    while start < len(response):
        if not mask[start]:
            start += 1
            continue
        end = start
        while end < len(response) and mask[end]:
            end += 1
        bad, nearest = _unsampled(response[start:end], sampled)
        if bad is not None:
            return TrainedDrift(
                rollout_id,
                "transition",
                nearest.call_id if nearest is not None else None,
                transition.agent_name,
                transition=index,
                position=start + bad,
            )
        start = end
    return None


def _unsampled(run: Sequence[int], calls: Sequence[LLMCall]) -> tuple[int | None, LLMCall | None]:
    """None when ``run`` is a concatenation of the calls' responses; else the furthest it
    can be read as one and the call whose response reached that far."""
    by_first: dict[int, list[LLMCall]] = {}
    for call in calls:
        by_first.setdefault(call.response_token_ids[0], []).append(call)  # type: ignore[index]
    reachable = [False] * (len(run) + 1)
    reachable[0] = True
    furthest, nearest = 0, None
    for i in range(len(run)):
        if not reachable[i]:
            continue
        for call in by_first.get(run[i], ()):
            ids = call.response_token_ids or []
            matched = _common(ids, run[i:])
            if matched == len(ids):
                reachable[i + matched] = True
            if i + matched > furthest:
                furthest, nearest = i + matched, call
    if reachable[len(run)]:
        return None, None
    return furthest, nearest


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def audit_calls(
    calls: Sequence[LLMCall],
    tokenizer: Any | None = None,
    *,
    transitions: Sequence[Transition] | None = None,
    config: TrajectoryConfig | None = None,
    rollout_id: str | None = None,
    trains: bool = True,
) -> RolloutAudit:
    """Audit one rollout attempt's calls (both checks for each, in the builder's order) and
    the trained-token drift of what the builder would train of them under ``config``
    (default :class:`TrajectoryConfig`): with ``transitions`` (the attempt's explicit ones)
    those its ``agent_filter`` keeps, else the calls it would re-tokenize
    (``missing_token_ids="retokenize"``). ``tokenizer`` may be None: the template checks are
    then not checkable, and divergences show ids only. ``rollout_id`` names the rollout (by
    default the calls' own); ``trains=False`` (a validation rollout, never
    trained) looks for no trained-token drift."""
    config = config or TrajectoryConfig()
    calls = ordered(calls)
    templates = template_checks(calls, tokenizer)
    audits = tuple(
        audit_call(call, previous, tokenizer, template)
        for call, previous, template in zip(calls, previous_calls(calls), templates, strict=True)
    )
    rollout_id = rollout_id or (calls[0].rollout_id if calls else "")
    attempt_id = calls[-1].attempt_id if calls else None
    drift: list[TrainedDrift] = []
    if trains and transitions is not None:
        for i, tr in enumerate(transitions):
            if config.trains_agent(tr.agent_name):
                found = transition_drift(tr, i, calls, rollout_id)
                drift += [found] if found is not None else []
    elif trains and config.missing_token_ids == "retokenize":
        drift = [
            retokenized_drift(c)
            for c in calls
            if not c.has_token_ids and c.finish_reason != ABANDONED
            and config.trains_agent(c.agent_name)
        ]  # fmt: skip
    return RolloutAudit(rollout_id, attempt_id, audits, tuple(drift))


def _ids(ids: Sequence[int]) -> str:
    return " ".join(f"#{i}" for i in ids)
