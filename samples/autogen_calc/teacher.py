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

import re

from arithmetic_teacher import Template, word_problem_teacher

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

teacher_reply = word_problem_teacher(TEMPLATES, tool="calculator", answer="{}", digits=6)
"""The assistant message for a chat-completions request of the AutoGen agent."""
