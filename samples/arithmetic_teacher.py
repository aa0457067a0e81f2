"""What the arithmetic word-problem teachers of ``autogen_calc`` and ``calc_mcp`` share: a
scripted, imperfect solver for ``samples/teacher_server.py``.

A sample gives its problem templates (a regex per template of its ``data.py``, the expression
that solves it, expressions with a wrong operator or a term left out), its tool's name and its
answer format; :func:`word_problem_teacher` makes its ``teacher_reply``. Once per episode
(``rng`` draws the same numbers on every call of an episode) the teacher decides whether and
how to err, at the rates of :data:`MISTAKES`: answering from mental arithmetic without the
tool (right :data:`MENTAL_RIGHT` of the time, else off by a slip), a wrong operator, a missing
term, a misread number, or a misreported tool result; right otherwise (about 62%). The format
of its messages is the same whether it is right or wrong.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple


class Template(NamedTuple):
    """One problem template of ``data.py``: how to read it and the expressions it leads to."""

    name: str
    pattern: re.Pattern[str]
    right: str
    """The expression that solves it, a format string over the pattern's named groups."""
    wrong_ops: tuple[str, ...]
    """Expressions with a wrong operator."""
    missing: tuple[str, ...] = ()
    """Expressions with a term left out (none for one-operation templates)."""


#: (mistake, cumulative probability): drawn once per episode.
MISTAKES: tuple[tuple[str, float], ...] = (
    ("mental", 0.15),
    ("operator", 0.25),
    ("missing", 0.33),
    ("misread", 0.38),
    ("report", 0.42),
)
MENTAL_RIGHT = 0.25
"""The share of mental-arithmetic answers that are right."""
SLIPS = (-10, -2, -1, 1, 2, 10)

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> float:
    """The value of an expression of numbers and ``+ - * /`` (the calculator's arithmetic)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            right = ev(node.right)
            return ev(node.left) / right if right else 0.0
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        raise ValueError(f"not arithmetic: {expression!r}")

    return ev(ast.parse(expression, mode="eval").body)


def number(value: float, digits: int = 6) -> str:
    """``84`` for whole numbers, else up to ``digits`` significant digits (as the calculator
    does)."""
    return str(int(value)) if float(value).is_integer() else f"{value:.{digits}g}"


def misread(value: str, draw: float) -> str:
    """A whole number copied wrong: its last two digits swapped when they differ (and the
    number keeps its length), else one more or one less."""
    sign, digits = ("-", value[1:]) if value.startswith("-") else ("", value)
    if len(digits) >= 2 and digits[-1] != digits[-2] and (len(digits) > 2 or digits[-1] != "0"):
        return sign + digits[:-2] + digits[-1] + digits[-2]
    return str(int(value) + (1 if draw < 0.5 or value == "0" else -1))


def text_of(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            text_of(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content
        )
    return "" if content is None else json.dumps(content)


def listed(value: Any) -> list[Any]:
    """``value`` when it is a list, else an empty list (a request field of the wrong shape)."""
    return value if isinstance(value, list) else []


class Plan(NamedTuple):
    """What the teacher does in one episode: the expression it calls, or the number it says."""

    expression: str | None
    """The calculator input, or None to answer without the tool."""
    answer: float
    """The number it believes is the answer (the value of the expression, or mental)."""
    misreport: bool = False
    """Whether it reports the tool's result wrong."""


def plan(question: str, rng: random.Random, templates: Sequence[Template]) -> Plan:
    """The episode's plan for ``question``. Draws the same numbers in the same order always."""
    kind_draw, mental_draw, slip_draw, variant_draw, operand_draw, side_draw = (
        rng.random() for _ in range(6)
    )
    kind = next((k for k, p in MISTAKES if kind_draw < p), "right")
    for template in templates:
        match = template.pattern.search(question)
        if match:
            break
    else:
        numbers = [int(n) for n in re.findall(r"\d+", question)] or [int(slip_draw * 40) + 3]
        return Plan(None, sum(numbers))
    values = match.groupdict()
    right = template.right.format(**values)
    correct = evaluate(right)
    if kind == "missing" and not template.missing:
        kind = "misread"
    if kind == "mental":
        slip = 0 if mental_draw < MENTAL_RIGHT else SLIPS[int(slip_draw * len(SLIPS))]
        return Plan(None, correct + slip if correct + slip >= 0 else correct - slip)
    if kind in ("operator", "missing"):
        options = template.wrong_ops if kind == "operator" else template.missing
        expression = options[int(variant_draw * len(options))].format(**values)
        return Plan(expression, evaluate(expression))
    if kind == "misread":
        names = list(values)
        name = names[int(operand_draw * len(names))]
        expression = template.right.format(**{**values, name: misread(values[name], side_draw)})
        return Plan(expression, evaluate(expression))
    return Plan(right, correct, misreport=kind == "report")


def word_problem_teacher(
    templates: Sequence[Template], *, tool: str, answer: str = "{}", digits: int = 6
) -> Callable[[dict[str, Any], random.Random], dict[str, Any]]:
    """A sample's ``teacher_reply``: it reads the problem with ``templates``, calls the tool
    (named in the request, else ``tool``) with the episode's expression, and answers
    ``answer.format(number)`` (numbers with up to ``digits`` significant digits) once the
    tool's result is back, or at once when it plans no tool call or may not call one."""

    def final(value: float, misreport: bool, draw: float) -> dict[str, Any]:
        text = number(value, digits)
        if misreport:
            text = misread(text, draw) if text.lstrip("-").isdigit() else number(value + 1, digits)
        return {"content": answer.format(text)}

    def teacher_reply(request: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        request = request if isinstance(request, dict) else {}
        messages = [m for m in listed(request.get("messages")) if isinstance(m, dict)]
        question = next(
            (text_of(m.get("content")) for m in messages if m.get("role") == "user"), ""
        )
        episode = plan(question, rng, templates)
        report_draw = rng.random()
        last_assistant = max(
            (i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1
        )
        results = [
            text_of(m.get("content"))
            for m in messages[last_assistant + 1 :]
            if m.get("role") in ("tool", "function")
        ]
        if results:
            found = re.findall(r"-?\d+(?:\.\d+)?", results[-1].replace(",", ""))
            failed = re.search(r"error|exception|failed", results[-1], re.IGNORECASE)
            value = float(found[-1]) if found and not failed else episode.answer
            return final(value, episode.misreport, report_draw)
        tools = [t for t in listed(request.get("tools")) if isinstance(t, dict)]
        if episode.expression is None or request.get("tool_choice") == "none" or not tools:
            return final(episode.answer, False, report_draw)
        function = tools[0].get("function")
        name = function.get("name") if isinstance(function, dict) else None
        name = name if isinstance(name, str) and name else tool
        return {
            "content": None,
            "tool_calls": [{"name": name, "arguments": {"expression": episode.expression}}],
        }

    return teacher_reply
