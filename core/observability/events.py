"""The events a rollout recorded, and the metrics a step makes of them.

An agent records how a rollout ended with :func:`voltrl.emit_event` (a zero-length span):
tau2's ``episode`` with its termination and score, werewolf's ``game`` with its winner and
how legally its players answered. The dashboard shows them on the rollout page and filters
rollouts on them; LocalRL logs, for each step's rollouts and each validation's,
:func:`event_metrics` of the events their final attempts recorded:

``<mode>/events/<event>.<field>``, the mean of each number or boolean (counted 0 or 1) field
over the events that recorded it. Texts, mappings and lists are left out: a text that should be
charted is recorded as a number or boolean too (werewolf's ``legal_choices`` beside its
``answers``), which keeps the metrics the same from step to step.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from voltrl.store.base import Store
from voltrl.types import Rollout, Span


@dataclass
class Event:
    """An event the rollout recorded (a zero-length span): its name and attributes."""

    name: str
    attributes: dict[str, Any]


def events(spans: Sequence[Span]) -> list[Event]:
    """The events among ``spans`` (zero-length spans, as :func:`voltrl.emit_event` records
    them), in the order they were recorded."""
    found = [s for s in spans if s.end_time is not None and s.end_time == s.start_time]
    found.sort(key=lambda s: s.start_time)
    return [Event(s.name, dict(s.attributes)) for s in found]


async def rollout_events(store: Store, rollouts: Iterable[Rollout]) -> list[Event]:
    """The events the final attempts of the succeeded ``rollouts`` recorded."""
    done = [r for r in rollouts if r.status == "succeeded"]
    spans = await asyncio.gather(*(store.get_spans(r.rollout_id, r.final_attempt_id) for r in done))
    return [e for recorded in spans for e in events(recorded)]


def event_metrics(found: Iterable[Event]) -> dict[str, float]:
    """The mean of each number or boolean field of these events, named ``<event>.<field>``,
    in name order; texts, mappings, lists, None and NaN are left out."""
    numbers: dict[str, list[float]] = {}
    for event in found:
        for field, value in event.attributes.items():
            if isinstance(value, bool | int | float) and math.isfinite(value):
                numbers.setdefault(f"{event.name}.{field}", []).append(float(value))
    return {key: sum(v) / len(v) for key, v in sorted(numbers.items())}


async def step_event_metrics(
    store: Store, rollouts: Iterable[Rollout], mode: str
) -> dict[str, float]:
    """:func:`event_metrics` of the ``rollouts``' events, named ``<mode>/events/...``."""
    found = await rollout_events(store, rollouts)
    return {f"{mode}/events/{name}": v for name, v in event_metrics(found).items()}
