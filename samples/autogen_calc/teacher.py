"""A scripted teacher for the AutoGen calculator agent (served by ``samples/teacher_server.py``).

The policy reads the problem from the first user message (one regex per template of
``data.py``), calls ``calculator`` once with one expression in a fixed style (numbers in the
order the problem gives them, one space around each operator: ``12 * 7``, ``40 + 25 - 9``,
``50 - 6 * 7``, ``20 * 5 + 13``, ``84 / 7``), and when the tool's result comes back answers
with the number only, as the system prompt asks (``84``). A request with no tools, or one
that forbids them (``tool_choice: "none"``), gets the answer at once.

It is right about 62% of the time. Once per episode (``rng`` is the same on every call of
an episode) it decides whether and how to err; the mistakes are behaviours a policy can learn
to avoid, and the format of the messages is the same whether the answer is right or wrong:

- ~15% answers from mental arithmetic without calling the tool: a quarter of those get it
  right, the rest slip (off by 1, 2 or 10);
- ~10% calls the tool with a wrong operator (``12 + 7`` for boxes, ``40 + 25 + 9`` for a
  give-away, ``84 * 7`` for a share...);
- ~5% calls the tool with a term missing (``40 + 25``: forgot what was given away;
  ``6 * 7``: the cost, not the change; ``20 * 5``: forgot the extra pages);
- ~8% misreads a number of the problem into the expression (``46`` as ``64``, ``7`` as ``8``;
  this takes the place of a missing term for boxes and shares, which have one operation);
- ~4% calls the tool right but misreports its result (``84`` as ``48``, ``9`` as ``10``).

A problem it cannot parse gets a plausible wrong number (the sum of the problem's numbers)
without a tool call.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from typing import Any, NamedTuple

TOOL = "calculator"
"""The tool's name when the request does not list one."""


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


TEMPLATES: tuple[Template, ...] = (
    Template(
        "boxes",
        re.compile(r"has (?P<a>\d+) boxes with (?P<b>\d+) \w+ in each box"),
        "{a} * {b}",
        ("{a} + {b}",),
    ),
    Template(
        "bought_gave",
        re.compile(r"had (?P<a>\d+) \w+, bought (?P<b>\d+) more, then gave away (?P<c>\d+)"),
        "{a} + {b} - {c}",
        ("{a} + {b} + {c}", "{a} - {b} - {c}"),
        ("{a} + {b}", "{a} - {c}"),
    ),
    Template(
        "change",
        re.compile(
            r"for (?P<p>\d+) dollars each\. \w+ buys (?P<n>\d+) of them and pays with "
            r"(?P<paid>\d+) dollars"
        ),
        "{paid} - {p} * {n}",
        ("{paid} - {p} - {n}", "{paid} - {p} + {n}"),
        ("{p} * {n}",),
    ),
    Template(
        "pages",
        re.compile(r"reads (?P<a>\d+) pages a day for (?P<b>\d+) days, then (?P<c>\d+) more"),
        "{a} * {b} + {c}",
        ("{a} + {b} + {c}", "{a} * {b} - {c}"),
        ("{a} * {b}",),
    ),
    Template(
        "share",
        re.compile(r"shares (?P<t>\d+) \w+ equally among (?P<k>\d+) friends"),
        "{t} / {k}",
        ("{t} * {k}", "{t} - {k}"),
    ),
)

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


def number(value: float) -> str:
    """``84`` for whole numbers, else up to six significant digits (as the calculator does)."""
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


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


def plan(question: str, rng: random.Random) -> Plan:
    """The episode's plan for ``question``. Draws the same numbers in the same order always."""
    kind_draw, mental_draw, slip_draw, variant_draw, operand_draw, side_draw = (
        rng.random() for _ in range(6)
    )
    kind = next((k for k, p in MISTAKES if kind_draw < p), "right")
    for template in TEMPLATES:
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


def final(value: float, misreport: bool, draw: float) -> dict[str, Any]:
    """The final answer message: the number only."""
    text = number(value)
    if misreport:
        text = misread(text, draw) if text.lstrip("-").isdigit() else number(value + 1)
    return {"content": text}


def teacher_reply(request: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The assistant message for a chat-completions ``request`` of the AutoGen agent."""
    request = request if isinstance(request, dict) else {}
    messages = [m for m in listed(request.get("messages")) if isinstance(m, dict)]
    question = next((text_of(m.get("content")) for m in messages if m.get("role") == "user"), "")
    episode = plan(question, rng)
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
    name = name if isinstance(name, str) and name else TOOL
    return {
        "content": None,
        "tool_calls": [{"name": name, "arguments": {"expression": episode.expression}}],
    }
