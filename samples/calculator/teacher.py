"""A scripted teacher for the calculator agent (served by ``samples/teacher_server.py``).

The policy reads ``What is a OP b?`` from the first user message, calls ``calculator`` with
``a OP b`` and, when the result comes back, answers ``The answer is N.``. It is right about
62% of the time: once per episode it may answer from mental arithmetic without the tool
(usually off by a slip), use a wrong operator, misread a number, or misreport the tool's
result, at the rates of ``samples/arithmetic_teacher.py``. The format of its messages is the
same whether it is right or wrong, so a student warmed up on all its episodes learns the
conversation and inherits these habits; RL has to unlearn them.
"""

from __future__ import annotations

import re

from arithmetic_teacher import Template, word_problem_teacher


def _template(name: str, op: str, wrong: tuple[str, ...]) -> Template:
    pattern = re.compile(rf"What is (?P<a>\d+) {re.escape(op)} (?P<b>\d+)\?")
    return Template(name, pattern, f"{{a}} {op} {{b}}", wrong)


TEMPLATES: tuple[Template, ...] = (
    _template("add", "+", ("{a} - {b}", "{a} * {b}")),
    _template("subtract", "-", ("{a} + {b}", "{b} - {a}")),
    _template("multiply", "*", ("{a} + {b}",)),
)

teacher_reply = word_problem_teacher(TEMPLATES, tool="calculator", answer="The answer is {}.")
"""The assistant message for a chat-completions request of the calculator agent."""
