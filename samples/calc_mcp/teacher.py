"""A scripted teacher for the Agent Framework agent with the MCP calculator (served by
``samples/teacher_server.py``).

The policy reads the problem from the first user message (one regex per template of
``data.py``), calls ``calculate`` once with one expression in a fixed style (the one
``data.py`` records: numbers in the order the problem gives them, one space around each
operator: ``46 + 10 * 3``, ``120 - 17 * 6``, ``72 / 8 - 2``), and when the tool's result comes
back answers with one line, as the instructions ask (``Answer: 76``). A request with no tools,
or one that forbids them (``tool_choice: "none"``), gets the answer at once.

It is right about 62% of the time. Once per episode (``rng`` is the same on every call of
an episode) it decides whether and how to err; the mistakes are behaviours a policy can learn
to avoid, and the format of the messages is the same whether the answer is right or wrong:

- ~15% answers from mental arithmetic without calling the tool: a quarter of those get it
  right, the rest slip (off by 1, 2 or 10);
- ~10% calls the tool with a wrong operator (``46 + 10 + 3`` for bags of marbles,
  ``120 - 17 - 6`` for change, ``72 * 8 - 2`` for a share...);
- ~8% calls the tool with a term missing (``10 * 3``: forgot the marbles Ana had; ``17 * 6``:
  the cost, not the change; ``72 / 8``: forgot the cookies eaten);
- ~5% misreads a number of the problem into the expression (``46`` as ``64``, ``7`` as ``8``);
- ~4% calls the tool right but misreports its result (``76`` as ``67``, ``9`` as ``10``).

A problem it cannot parse gets a plausible wrong number (the sum of the problem's numbers)
without a tool call.
"""

from __future__ import annotations

import re

from arithmetic_teacher import Template, word_problem_teacher

TEMPLATES: tuple[Template, ...] = (
    Template(
        "bags",
        re.compile(
            r"has (?P<a>\d+) marbles and buys (?P<b>\d+) bags with (?P<c>\d+) marbles in each"
        ),
        "{a} + {b} * {c}",
        ("{a} + {b} + {c}", "{a} * {b} + {c}"),
        ("{b} * {c}",),
    ),
    Template(
        "change",
        re.compile(
            r"costs (?P<p>\d+) dollars\. \w+ buys (?P<n>\d+) notebooks and pays with "
            r"(?P<paid>\d+) dollars"
        ),
        "{paid} - {p} * {n}",
        ("{paid} - {p} - {n}", "{paid} + {p} * {n}"),
        ("{p} * {n}",),
    ),
    Template(
        "reading",
        re.compile(r"reads (?P<a>\d+) pages a day for (?P<b>\d+) days, then (?P<c>\d+) more"),
        "{a} * {b} + {c}",
        ("{a} + {b} + {c}", "{a} * {b} - {c}"),
        ("{a} * {b}",),
    ),
    Template(
        "sharing",
        re.compile(
            r"shares (?P<t>\d+) cookies equally among (?P<k>\d+) children\. Each child eats "
            r"(?P<e>\d+)"
        ),
        "{t} / {k} - {e}",
        ("{t} * {k} - {e}", "{t} / {k} + {e}"),
        ("{t} / {k}",),
    ),
    Template(
        "trip",
        re.compile(
            r"drives at (?P<s>\d+) km per hour for (?P<h>\d+) hours and then walks (?P<w>\d+)"
        ),
        "{s} * {h} + {w}",
        ("{s} + {h} + {w}", "{s} * {h} - {w}"),
        ("{s} * {h}",),
    ),
    Template(
        "savings",
        re.compile(
            r"saves (?P<w>\d+) dollars every week for (?P<n>\d+) weeks and spends (?P<s>\d+)"
        ),
        "{w} * {n} - {s}",
        ("{w} * {n} + {s}", "{w} + {n} - {s}"),
        ("{w} * {n}",),
    ),
)

teacher_reply = word_problem_teacher(TEMPLATES, tool="calculate", answer="Answer: {}", digits=10)
"""The assistant message for a chat-completions request of the Agent Framework agent."""
