"""Arithmetic word problems for the AutoGen calculator agent, generated from a seed.

Each row is ``{"question": str, "answer": int}``; every answer is a whole number, and every
problem needs one or two operations, so a model that copies the calculator's results can
solve it.
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


def _boxes(rng: random.Random, name: str, item: str) -> Problem:
    a, b = rng.randint(3, 40), rng.randint(3, 25)
    return f"{name} has {a} boxes with {b} {item} in each box. How many {item} is that?", a * b


def _bought_gave(rng: random.Random, name: str, item: str) -> Problem:
    a, b = rng.randint(10, 200), rng.randint(5, 120)
    c = rng.randint(1, a + b)
    question = (
        f"{name} had {a} {item}, bought {b} more, then gave away {c}. "
        f"How many {item} does {name} have now?"
    )
    return question, a + b - c


def _change(rng: random.Random, name: str, item: str) -> Problem:
    price, count = rng.randint(2, 30), rng.randint(2, 12)
    paid = price * count + rng.randint(0, 50)
    question = (
        f"A shop sells {item} for {price} dollars each. {name} buys {count} of them and pays "
        f"with {paid} dollars. How much change does {name} get, in dollars?"
    )
    return question, paid - price * count


def _pages(rng: random.Random, name: str, _item: str) -> Problem:
    a, b, c = rng.randint(5, 60), rng.randint(2, 14), rng.randint(1, 90)
    question = (
        f"{name} reads {a} pages a day for {b} days, then {c} more pages. "
        f"How many pages did {name} read in all?"
    )
    return question, a * b + c


def _share(rng: random.Random, name: str, item: str) -> Problem:
    each, friends = rng.randint(2, 30), rng.randint(2, 12)
    question = (
        f"{name} shares {each * friends} {item} equally among {friends} friends. "
        f"How many {item} does each friend get?"
    )
    return question, each


TEMPLATES: tuple[Callable[[random.Random, str, str], Problem], ...] = (
    _boxes,
    _bought_gave,
    _change,
    _pages,
    _share,
)


def make_problems(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` word problems with their answers, the same for the same ``seed``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        template = rng.choice(TEMPLATES)
        question, answer = template(rng, rng.choice(NAMES), rng.choice(ITEMS))
        rows.append({"question": question, "answer": answer})
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: Path) -> Path:
    """Write ``rows`` as JSON lines; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
