"""The events a rollout recorded, and the metrics a step makes of them.

An agent records how a rollout ended with :func:`voltrl.emit_event` (a zero-length span):
tau2's ``episode`` with its termination and score, werewolf's ``game`` with its winner and
how legally its players answered. The dashboard shows them on the rollout page and filters
rollouts on them; LocalRL logs, for each step's rollouts and each validation's,
:func:`event_metrics` of the events their final attempts recorded:

- ``<mode>/events/<event>.<field>``: the mean of a number (a boolean counts 0 or 1) over the
  events that recorded the field;
- ``<mode>/events/<event>.<field>=<value>``: for a text field, the share of those events with
  that value (``val/events/game.winner=wolves``), when the field took at most
  :data:`MAX_VALUES` values in those events (a free text is left out);
- mappings and lists are left out.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from voltrl.store.base import Store
from voltrl.types import Rollout, Span

MAX_VALUES = 10
"""The most values a text field may take in a step's events to be counted per value."""


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
    """The metrics of these events, named ``<event>.<field>`` and ``<event>.<field>=<value>``
    (see the module's docstring), in name order."""
    numbers: dict[str, list[float]] = {}
    texts: dict[str, list[str]] = {}
    for event in found:
        for field, value in event.attributes.items():
            key = f"{event.name}.{field}"
            if isinstance(value, bool | int | float):
                if math.isfinite(value):
                    numbers.setdefault(key, []).append(float(value))
            elif isinstance(value, str):
                texts.setdefault(key, []).append(value)
    out = {key: sum(values) / len(values) for key, values in numbers.items()}
    for key, values in texts.items():
        counts = Counter(values)
        if len(counts) <= MAX_VALUES:
            out.update({f"{key}={value}": n / len(values) for value, n in counts.items()})
    return dict(sorted(out.items()))


async def step_event_metrics(
    store: Store, rollouts: Iterable[Rollout], mode: str
) -> dict[str, float]:
    """:func:`event_metrics` of the ``rollouts``' events, named ``<mode>/events/...``."""
    found = await rollout_events(store, rollouts)
    return {f"{mode}/events/{name}": v for name, v in event_metrics(found).items()}
