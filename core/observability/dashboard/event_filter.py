"""The rollouts page's event filter: rollouts whose recorded events have given field values.

``termination=max_turns`` keeps the rollouts with an event (a zero-length span, as
:func:`voltrl.emit_event` records: tau2's ``episode``, werewolf's ``game``) whose attribute
``termination`` is ``max_turns``; ``episode.termination=max_turns`` asks it of the
``episode`` events only; ``winner=village, rounds=4``: both (each by any event). A value
matches as text, as a number (``4`` and ``4.0``) or as a boolean (``true``).

The store answers the other filters and the order; the events are read here, rollout by
rollout down that list, until the page is full or :data:`SCAN_CAP` rollouts were read (the
page then says how far it looked), so a filter costs the same on a store of any size.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any

from voltrl.observability.events import events
from voltrl.store.base import Store
from voltrl.store.browse import RolloutPage, RolloutQuery

SCAN_CAP = 1_000
"""Rollouts whose events one page reads at most."""
BATCH = 100
"""Rollouts read from the store at a time."""


@dataclass(frozen=True)
class Condition:
    """One ``[event.]field=value`` of the filter."""

    field: str
    value: str


def parse(text: str) -> list[Condition]:
    """The conditions of ``text`` (``field=value``, ``event.field=value``, comma-separated);
    raises :class:`ValueError` saying what is wrong."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        field, eq, value = part.partition("=")
        field, value = field.strip(), value.strip()
        if not eq or not field:
            raise ValueError(f"{part!r}: write field=value, e.g. termination=max_turns")
        out.append(Condition(field, value))
    return out


def _same(found: Any, wanted: str) -> bool:
    """Whether an attribute's value is ``wanted`` as written in the filter."""
    if isinstance(found, bool):
        return wanted.lower() == str(found).lower()
    if isinstance(found, int | float):
        try:
            number = float(wanted)
        except ValueError:
            return False
        return math.isclose(float(found), number, rel_tol=0.0, abs_tol=1e-12)
    if isinstance(found, str):
        return found == wanted
    return json.dumps(found, separators=(",", ":")) == wanted


def holds(condition: Condition, recorded: list[Any]) -> bool:
    """Whether one of the ``recorded`` events satisfies ``condition``: an attribute named as
    the whole field, or, for ``event.field``, the field of an event of that name."""
    for event in recorded:
        attrs = event.attributes
        if condition.field in attrs and _same(attrs[condition.field], condition.value):
            return True
        if condition.field.startswith(f"{event.name}."):
            field = condition.field[len(event.name) + 1 :]
            if field in attrs and _same(attrs[field], condition.value):
                return True
    return False


@dataclass
class Filtered:
    """A page of the rollouts whose events match, and how far the scan went."""

    page: RolloutPage
    """The page; ``total`` counts the matches found (one past the page at most, so that a
    next page is known), ``total_capped`` when the list was not read to its end."""
    scanned: int
    stopped: bool
    """Whether the scan stopped at its cap (the rollouts after it were not looked at)."""


async def filter_by_events(
    store: Store, query: RolloutQuery, conditions: list[Condition], cap: int = SCAN_CAP
) -> Filtered:
    """The page ``query`` asks for among its rollouts whose last attempt recorded events
    matching every condition (each by any event), reading at most ``cap`` rollouts."""
    wanted = query.offset + query.limit + 1  # one more: whether there is a next page
    matched: list[Any] = []
    scanned, ended = 0, False
    while len(matched) < wanted and scanned < cap:
        size = min(BATCH, cap - scanned)
        batch = await store.browse_rollouts(
            query.model_copy(update={"offset": scanned, "limit": size})
        )
        spans = await asyncio.gather(
            *(store.get_spans(r.rollout_id, r.final_attempt_id) for r in batch.rollouts)
        )
        for rollout, recorded in zip(batch.rollouts, spans, strict=True):
            found = events(recorded)
            if all(holds(c, found) for c in conditions):
                matched.append(rollout)
        scanned += len(batch.rollouts)
        if len(batch.rollouts) < size:
            ended = True
            break
    page = RolloutPage(
        rollouts=matched[query.offset : query.offset + query.limit],
        total=len(matched),
        total_capped=not ended,
    )
    return Filtered(page, scanned, stopped=not ended and len(matched) < wanted)
