"""Unit-conversion tasks, the ``convert`` tool's unit table, and the reward.

``make_tasks(n, seed)`` gives rows like ``{"question": "How many meters are in 3.5
kilometers?", "value": 3.5, "from_unit": "km", "to_unit": "m", "answer": 3500.0}``; the same
arguments give the same rows.
"""

from __future__ import annotations

import random
import re
from typing import Any

#: Units by dimension: the size of each in the dimension's base unit (meter, gram).
UNITS: dict[str, dict[str, float]] = {
    "length": {
        "mm": 0.001,
        "cm": 0.01,
        "m": 1.0,
        "km": 1000.0,
        "in": 0.0254,
        "ft": 0.3048,
        "mi": 1609.344,
    },
    "mass": {"g": 1.0, "kg": 1000.0, "oz": 28.349523125, "lb": 453.59237},
}
NAMES = {
    "mm": "millimeters",
    "cm": "centimeters",
    "m": "meters",
    "km": "kilometers",
    "in": "inches",
    "ft": "feet",
    "mi": "miles",
    "g": "grams",
    "kg": "kilograms",
    "oz": "ounces",
    "lb": "pounds",
}


def convert_units(value: float, from_unit: str, to_unit: str) -> float:
    """``value`` in ``from_unit`` expressed in ``to_unit`` (symbols as in :data:`UNITS`);
    ``ValueError`` for an unknown unit or units of different dimensions."""
    for table in UNITS.values():
        if from_unit in table and to_unit in table:
            return value * table[from_unit] / table[to_unit]
    known = sorted(u for table in UNITS.values() for u in table)
    raise ValueError(f"cannot convert {from_unit!r} to {to_unit!r}; units: {', '.join(known)}")


def make_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` conversion questions with their answers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        table = UNITS[rng.choice(sorted(UNITS))]
        src, dst = rng.sample(sorted(table), 2)
        value = rng.choice([rng.randint(1, 500), round(rng.uniform(0.5, 50), 1)])
        rows.append(
            {
                "question": f"How many {NAMES[dst]} are in {value} {NAMES[src]}?",
                "value": value,
                "from_unit": src,
                "to_unit": dst,
                "answer": float(f"{convert_units(value, src, dst):.6g}"),  # as the tool says it
            }
        )
    return rows


def last_number(text: str | None) -> float | None:
    """The last number in ``text`` (``1,234.5`` reads as 1234.5)."""
    found = re.findall(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", (text or "").replace(",", ""))
    return float(found[-1]) if found else None


def reward(answer: str | None, row: dict[str, Any]) -> float:
    """1 when the answer's last number is within 1% of the right one, else 0."""
    got, want = last_number(answer), float(row["answer"])
    if got is None:
        return 0.0
    return float(abs(got - want) <= 0.01 * max(abs(want), 1e-9))
