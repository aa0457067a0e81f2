"""Arithmetic word problems for the AutoGen calculator agent, generated from a seed.

Each row is ``{"question": str, "answer": int}``; every answer is a whole number, and every
problem needs one or two operations, so a model that copies the calculator's results can
solve it. ``max_number`` caps the numbers drawn for a problem (a share's total, their product,
may be larger): the CPU recipe's problems use numbers up to 20, which a tiny model copies
into its calculator call more often than numbers up to 200.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo")
ITEMS = ("apples", "marbles", "stickers", "pencils", "cards", "stamps", "shells", "books")

Problem = tuple[str, int]
Draw = Callable[[int, int], int]
"""``draw(lo, hi)``: a whole number from ``lo`` to ``hi`` (as ``random.randint``)."""


def _boxes(draw: Draw, name: str, item: str) -> Problem:
    a, b = draw(3, 40), draw(3, 25)
    return f"{name} has {a} boxes with {b} {item} in each box. How many {item} is that?", a * b


def _bought_gave(draw: Draw, name: str, item: str) -> Problem:
    a, b = draw(10, 200), draw(5, 120)
    c = draw(1, a + b)
    question = (
        f"{name} had {a} {item}, bought {b} more, then gave away {c}. "
        f"How many {item} does {name} have now?"
    )
    return question, a + b - c


def _change(draw: Draw, name: str, item: str) -> Problem:
    price, count = draw(2, 30), draw(2, 12)
    paid = price * count + draw(0, 50)
    question = (
        f"A shop sells {item} for {price} dollars each. {name} buys {count} of them and pays "
        f"with {paid} dollars. How much change does {name} get, in dollars?"
    )
    return question, paid - price * count


def _pages(draw: Draw, name: str, _item: str) -> Problem:
    a, b, c = draw(5, 60), draw(2, 14), draw(1, 90)
    question = (
        f"{name} reads {a} pages a day for {b} days, then {c} more pages. "
        f"How many pages did {name} read in all?"
    )
    return question, a * b + c


def _share(draw: Draw, name: str, item: str) -> Problem:
    each, friends = draw(2, 30), draw(2, 12)
    question = (
        f"{name} shares {each * friends} {item} equally among {friends} friends. "
        f"How many {item} does each friend get?"
    )
    return question, each


TEMPLATES: tuple[Callable[[Draw, str, str], Problem], ...] = (
    _boxes,
    _bought_gave,
    _change,
    _pages,
    _share,
)


def make_problems(n: int, seed: int, *, max_number: int | None = None) -> list[dict[str, Any]]:
    """``n`` word problems with their answers, the same for the same ``seed``; every number
    drawn is at most ``max_number`` (or the template's least number, when that is larger)."""
    rng = random.Random(seed)

    def draw(lo: int, hi: int) -> int:
        return rng.randint(lo, hi if max_number is None else max(lo, min(hi, max_number)))

    rows = []
    for _ in range(n):
        template = rng.choice(TEMPLATES)
        question, answer = template(draw, rng.choice(NAMES), rng.choice(ITEMS))
        rows.append({"question": question, "answer": answer})
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: Path) -> Path:
    """Write ``rows`` as JSON lines; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
