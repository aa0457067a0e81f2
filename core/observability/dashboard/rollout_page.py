"""The rollout page and the parts of it fetched when opened.

The page reads top to bottom as a reader asks: how did it end (the outcome: the events and
rewards the rollout recorded, :mod:`.conversation`), what was it (the task), what was said
(every call as one conversation), what was trained (the training rows, each reward and
advantage explained), then the attempts; the spans and the full list of rewards are folded at
the bottom.

Nothing on the page is per token. Each call's and each row's token view, a call's whole
request, the spans and the rewards are a ``<details>`` whose content this module serves as
an HTML fragment when the reader opens it (``static/dashboard.js``); the training rows, which
take the step's rollouts to rebuild, come the same way as soon as the page has loaded. A game
of hundreds of calls with thousands of prompt tokens each is a page of a few hundred
kilobytes, and what the reader opens costs one call's tokens.

=================================================  ============================================
``/rollouts/{id}``                                 the page
``/rollouts/{id}/calls/{attempt}/{seq}/tokens``    a call's tokens: its token-drift audit, the
                                                   response, then the prompt (where a check
                                                   diverges marked)
``/rollouts/{id}/calls/{attempt}/{seq}/request``   a call's whole request
``/rollouts/{id}/rows``                            the training rows (fetched once the page loaded)
``/rollouts/{id}/rows/{index}/tokens``             a training row's tokens and loss mask
``/rollouts/{id}/spans``, ``.../rewards``          the span tree, every reward
=================================================  ============================================

(``attempt`` is the attempt's number, ``seq`` the call's sequence id in it.) A finished
rollout's page data (its conversation clipped, its events) is kept for the next visit
(:data:`PAGES_KEPT` rollouts).
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from voltrl.errors import NotFoundError
from voltrl.observability.dashboard import conversation, data, training_rows
from voltrl.observability.events import Event, events
from voltrl.store.base import Store
from voltrl.trajectory.audit import CallAudit, audit_call, ordered, previous_calls
from voltrl.types import Attempt, LLMCall, Rollout

Page = Callable[..., HTMLResponse]
"""``page(request, template, status=200, **context)``: a rendered template (the app's)."""


def add_rollout_pages(app: FastAPI, catalog: data.Catalog, page: Page) -> None:
    """Route the rollout page and its parts on ``app``."""

    @app.get("/rollouts/{rollout_id}", response_class=HTMLResponse, name="rollout")
    async def rollout(request: Request, rollout_id: str, calls: int = 1) -> HTMLResponse:
        store, ro, entry = await catalog.rollout(rollout_id)
        attempts, shown = await _page_data(store, ro)
        first = max(0, calls - 1)  # the first call this page shows (calls: counted from 1)
        return page(
            request,
            "rollout.html",
            ro=ro,
            entry=entry,
            attempts=attempts,
            shown=shown,
            turns=shown.turns[first : first + conversation.CALLS_PER_PAGE],
            first=first,
            per_page=conversation.CALLS_PER_PAGE,
            token_note=data.tokenizer_dir(entry)[1],
            attempt_index={a.attempt_id: a.index for a in attempts},
            live=not ro.finished,
        )

    @app.get(
        "/rollouts/{rollout_id}/calls/{attempt}/{sequence}/tokens", response_class=HTMLResponse
    )
    async def call_tokens(
        request: Request, rollout_id: str, attempt: int, sequence: int
    ) -> HTMLResponse:
        store, ro, entry = await catalog.rollout(rollout_id)
        call, previous = await _call_and_previous(store, ro, attempt, sequence)
        if not call.has_token_ids:
            return page(request, "tokens.html", ids=False)
        view = await _token_view(
            entry,
            call.prompt_token_ids or [],
            call.response_token_ids or [],
            call.response_logprobs or [],
            audited=(call, previous),
        )
        return page(request, "tokens.html", ids=True, exp=_prob, **view)

    @app.get(
        "/rollouts/{rollout_id}/calls/{attempt}/{sequence}/request", response_class=HTMLResponse
    )
    async def call_request(
        request: Request, rollout_id: str, attempt: int, sequence: int
    ) -> HTMLResponse:
        store, ro, _ = await catalog.rollout(rollout_id)
        call = await _call(store, ro, attempt, sequence)
        messages = [m for m in call.request.get("messages") or [] if isinstance(m, dict)]
        whole = [conversation.message(m, None) for m in messages]
        return page(request, "request.html", messages=whole, call=call)

    @app.get("/rollouts/{rollout_id}/rows", response_class=HTMLResponse)
    async def rollout_rows(request: Request, rollout_id: str) -> HTMLResponse:
        _, ro, entry = await catalog.rollout(rollout_id)
        rows, note = await _rows(ro, entry)
        return page(
            request,
            "rows.html",
            entry=entry,
            rows=rows,
            rows_note=note,
            credit_note=training_rows.credit_note(entry.run) if entry else "",
            advantage_note=training_rows.advantage_note,
        )

    @app.get("/rollouts/{rollout_id}/rows/{index}/tokens", response_class=HTMLResponse)
    async def row_tokens(request: Request, rollout_id: str, index: int) -> HTMLResponse:
        _, ro, entry = await catalog.rollout(rollout_id)
        rows, note = await _rows(ro, entry)
        if not 0 <= index < len(rows):
            raise NotFoundError(f"rollout {rollout_id!r} has no training row {index} ({note})")
        row = rows[index]
        view = await _token_view(entry, row.prompt, row.response, row.logprobs, row.mask)
        return page(request, "tokens.html", ids=True, exp=_prob, **view)

    @app.get("/rollouts/{rollout_id}/spans", response_class=HTMLResponse)
    async def rollout_spans(request: Request, rollout_id: str) -> HTMLResponse:
        store, _, _ = await catalog.rollout(rollout_id)
        attempts, spans = await asyncio.gather(
            store.get_attempts(rollout_id), store.get_spans(rollout_id)
        )
        return page(
            request,
            "spans.html",
            spans=data.span_tree(spans),
            attempts=len(attempts),
            attempt_index={a.attempt_id: a.index for a in attempts},
        )

    @app.get("/rollouts/{rollout_id}/rewards", response_class=HTMLResponse)
    async def rollout_rewards(request: Request, rollout_id: str) -> HTMLResponse:
        store, _, _ = await catalog.rollout(rollout_id)
        return page(request, "rewards.html", rewards=await store.get_rewards(rollout_id))


async def _call(store: Store, ro: Rollout, attempt: int, sequence: int) -> LLMCall:
    """Call ``sequence`` of attempt number ``attempt`` of ``ro``; raises
    :class:`NotFoundError`."""
    return (await _call_and_previous(store, ro, attempt, sequence))[0]


async def _call_and_previous(
    store: Store, ro: Rollout, attempt: int, sequence: int
) -> tuple[LLMCall, LLMCall | None]:
    """Call ``sequence`` of attempt number ``attempt`` of ``ro`` and its agent's previous
    call, the one it should continue (:func:`~voltrl.trajectory.audit.previous_calls`);
    raises :class:`NotFoundError`."""
    attempts = await store.get_attempts(ro.rollout_id)
    found = next((a for a in attempts if a.index == attempt), None)
    if found is not None:
        calls = ordered(await store.get_llm_calls(ro.rollout_id, found.attempt_id))
        for call, previous in zip(calls, previous_calls(calls), strict=True):
            if call.sequence_id == sequence:
                return call, previous
    raise NotFoundError(f"rollout {ro.rollout_id!r} has no call {sequence} in attempt {attempt}")


@dataclass
class Shown:
    """What a rollout page shows of its records: the conversation, the outcome (events of
    the last attempt, its rewards by name), and how many spans and rewards are folded."""

    turns: list[conversation.Turn]
    events: list[Event]
    reward_lines: list[conversation.RewardLine]
    spans: int
    rewards: int


PAGES_KEPT = 16
"""Finished rollouts whose page data is kept (each a few hundred kilobytes at most)."""
_PAGES: OrderedDict[str, Shown] = OrderedDict()


async def _page_data(store: Store, ro: Rollout) -> tuple[list[Attempt], Shown]:
    """The rollout's attempts and what its page shows of its records (kept once finished:
    a finished rollout's records never change)."""
    attempts = await store.get_attempts(ro.rollout_id)
    kept = _PAGES.get(ro.rollout_id) if ro.finished else None
    if kept is not None:
        return attempts, kept
    calls, spans, rewards = await asyncio.gather(
        store.get_llm_calls(ro.rollout_id),
        store.get_spans(ro.rollout_id),
        store.get_rewards(ro.rollout_id),
    )
    final = ro.final_attempt_id
    turns = await asyncio.to_thread(conversation.thread, calls)
    for turn, marks in zip(turns, conversation.reward_marks(calls, rewards), strict=True):
        turn.rewards = marks
    shown = Shown(
        turns=turns,
        events=events([s for s in spans if final in (None, s.attempt_id)]),
        reward_lines=conversation.reward_lines(
            [w for w in rewards if final in (None, w.attempt_id)]
        ),
        spans=len(spans),
        rewards=len(rewards),
    )
    if ro.finished:
        data.keep_newest(_PAGES, ro.rollout_id, shown, PAGES_KEPT)
    return attempts, shown


async def _rows(
    ro: Rollout, entry: data.RunEntry | None
) -> tuple[list[training_rows.TrainingRow], str]:
    """The rollout's training rows and the note the page gives them."""
    if entry is None:
        return [], "the rollout's run is not in these stores"
    if not ro.finished:
        return [], "training rows appear once the rollout has finished"
    step = await training_rows.step_rows(entry, ro)
    if ro.rollout_id in step.dropped:
        why = step.dropped[ro.rollout_id]
        return [], f"the trajectory builder makes no training row of it ({why})"
    return step.rows.get(ro.rollout_id, []), step.note


async def _token_view(
    entry: data.RunEntry | None,
    prompt: Sequence[int],
    response: Sequence[int],
    logprobs: Sequence[float | None],
    mask: Sequence[int] | None = None,
    audited: tuple[LLMCall, LLMCall | None] | None = None,
) -> dict[str, Any]:
    """A token view's context: each response token with its logprob and loss mask (None:
    a call's, no mask), the prompt's tokens, how they were decoded (on a thread: a first
    tokenizer loads slowly); for a call (``audited``: it and its agent's previous call), its
    token-drift audit and the prompt positions where a check diverges."""

    def decode() -> dict[str, Any]:
        tokenizer, note = data.load_tokenizer(entry)
        texts = data.tokens(response, tokenizer)
        audit = audit_call(*audited, tokenizer) if audited is not None else None
        return {
            "audit": audit,
            "drift_at": _drift_positions(audit),
            "response": [
                (
                    text,
                    logprobs[i] if i < len(logprobs) else None,
                    mask[i] if mask is not None else None,
                )
                for i, text in enumerate(texts)
            ],
            "prompt": data.tokens(prompt, tokenizer),
            "note": note,
        }

    return await asyncio.to_thread(decode)


def _drift_positions(audit: CallAudit | None) -> dict[int, str]:
    """The prompt positions where a check of ``audit`` diverges, each with what it says."""
    found: dict[int, str] = {}
    if audit is None:
        return found
    for name, check in (("template", audit.template), ("continuation", audit.continuation)):
        if check.divergence is not None:
            at = check.divergence.position
            found[at] = " and ".join(filter(None, (found.get(at), f"{name} diverges here")))
    return found


def _prob(logprob: float | None) -> float:
    """A token's probability from its logprob (1 when unknown, so it shades fully)."""
    return 1.0 if logprob is None else math.exp(max(-50.0, logprob))
