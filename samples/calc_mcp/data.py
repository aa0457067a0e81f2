"""Arithmetic word problems with whole-number answers, generated from a seed.

Each problem takes two or three operations (``a + b * c``, ``a * b - c``, an equal share...),
so a model that does the arithmetic with the calculator gets it right. A row is
``{"question": ..., "answer": ..., "expression": ...}``; ``expression`` is one calculator input
that solves it (the agent never sees it). ``max_number`` caps the numbers drawn for a problem
(a product of them, a share's total, may be larger): the CPU recipe's problems use numbers up
to 20, which a tiny model copies into its calculator call more often than larger ones.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun")

Draw = Callable[[int, int], int]
"""``draw(lo, hi)``: a whole number from ``lo`` to ``hi`` (as ``random.randint``)."""
Template = Callable[[Draw, str], tuple[str, str, int]]


def _bags(draw: Draw, name: str) -> tuple[str, str, int]:
    a, b, c = draw(5, 60), draw(2, 12), draw(3, 25)
    question = (
        f"{name} has {a} marbles and buys {b} bags with {c} marbles in each bag. "
        f"How many marbles does {name} have now?"
    )
    return question, f"{a} + {b} * {c}", a + b * c


def _change(draw: Draw, name: str) -> tuple[str, str, int]:
    price, count = draw(3, 40), draw(2, 9)
    paid = price * count + draw(1, 50)
    question = (
        f"A notebook costs {price} dollars. {name} buys {count} notebooks and pays with "
        f"{paid} dollars. How many dollars of change does {name} get?"
    )
    return question, f"{paid} - {price} * {count}", paid - price * count


def _reading(draw: Draw, name: str) -> tuple[str, str, int]:
    per_day, days, extra = draw(8, 45), draw(3, 14), draw(5, 80)
    question = (
        f"{name} reads {per_day} pages a day for {days} days, then {extra} more pages on the "
        f"weekend. How many pages does {name} read in total?"
    )
    return question, f"{per_day} * {days} + {extra}", per_day * days + extra


def _sharing(draw: Draw, name: str) -> tuple[str, str, int]:
    children, each, eaten = draw(2, 9), draw(4, 20), draw(1, 3)
    question = (
        f"{name} shares {children * each} cookies equally among {children} children. Each "
        f"child eats {eaten} of their cookies. How many cookies does each child have left?"
    )
    return question, f"{children * each} / {children} - {eaten}", each - eaten


def _trip(draw: Draw, name: str) -> tuple[str, str, int]:
    speed, hours, walk = draw(30, 110), draw(2, 7), draw(2, 15)
    question = (
        f"{name} drives at {speed} km per hour for {hours} hours and then walks {walk} km. "
        f"How many km does {name} travel?"
    )
    return question, f"{speed} * {hours} + {walk}", speed * hours + walk


def _savings(draw: Draw, name: str) -> tuple[str, str, int]:
    weekly, weeks = draw(5, 60), draw(4, 20)
    spent = draw(10, min(90, weekly * weeks - 1))
    question = (
        f"{name} saves {weekly} dollars every week for {weeks} weeks and spends {spent} "
        f"dollars on a gift. How many dollars does {name} have left?"
    )
    return question, f"{weekly} * {weeks} - {spent}", weekly * weeks - spent


TEMPLATES: tuple[Template, ...] = (_bags, _change, _reading, _sharing, _trip, _savings)


def make_problems(n: int, seed: int = 0, *, max_number: int | None = None) -> list[dict[str, Any]]:
    """``n`` word problems with their answers, reproducible from ``seed``; every number drawn
    is at most ``max_number`` (or the template's least number, when that is larger)."""
    rng = random.Random(seed)

    def draw(lo: int, hi: int) -> int:
        return rng.randint(lo, hi if max_number is None else max(lo, min(hi, max_number)))

    rows = []
    for _ in range(n):
        question, expression, answer = rng.choice(TEMPLATES)(draw, rng.choice(NAMES))
        rows.append({"question": question, "answer": answer, "expression": expression})
    return rows
