"""Templated questions for a CPU recipe, and a scripted, imperfect teacher for the SQL agent.

**Questions** (:data:`POOL`). The 30 hand-written questions are too varied for a tiny model
trained from scratch, so the recipe asks about the shop's product prices with four templates
whose gold SQL differs only by the numbers copied from the question (rows as in
``questions.jsonl``'s ``question`` and ``gold_sql``):

- ``between``: Which products cost between 5 and 12?
  ``SELECT name FROM products WHERE price BETWEEN 5 AND 12``
- ``count``: How many products cost between 5 and 12?
  ``SELECT COUNT(*) FROM products WHERE price BETWEEN 5 AND 12``
- ``total``: What is the total price of the products costing between 5 and 12?
  ``SELECT SUM(price) FROM products WHERE price BETWEEN 5 AND 12``
- ``cost``: Which products cost more than 10? (or less than)
  ``SELECT name FROM products WHERE price > 10``

Ranges ``a < b`` within 1-40 and thresholds 1-36, kept where the gold query returns a non-empty,
non-NULL, non-zero answer: 2,083 distinct questions, too many to fit by heart (an earlier task
set of seven templates over names, cities and order ids had 134, and the student answered
held-out ones with the values it remembered).

**Teacher** (:func:`teacher_reply`), for ``samples/teacher_server.py``. The role of a request is
told by its system prompt (``agent.py``'s ``WRITE``, ``CHECK``, ``REWRITE``); the question is
parsed back with the templates' regexes and its gold query recomputed. Replies are short and
uniform:
``write`` and ``rewrite`` answer one ```` ```sql ```` block, ``check`` answers ``CORRECT`` or
``WRONG: <what to change>``.

- ``write`` (:data:`P_WRITE`): the gold query 50% of the time; otherwise one mistake, drawn
  evenly among a wrong column (``cost``, which does not exist, or ``price`` for ``name``), a
  missing ``WHERE`` filter, a wrong aggregate and wrong bounds (the range's numbers swapped, or the
  other comparison). A mistake that happens to return the gold rows is replaced by the next kind.
- ``check`` (:data:`P_CHECK`): runs the query and the gold query and gives the right verdict 85%
  of the time. Its review of a wrong query names the part to change (``WRONG: select name, not
  cost.``, ``WRONG: add WHERE price BETWEEN 5 AND 12.``, ``WRONG: use WHERE price > 10.``); a
  correct query it rejects gets ``WRONG: the result does not answer the question.``
- ``rewrite`` (:data:`P_REWRITE`): the gold query 35% of the time; otherwise the previous query
  again when it was wrong (half the time, :data:`P_REPEAT`), else a fresh mistake.

The graph's ``check`` and ``rewrite`` each send a fresh conversation whose first user message
holds the query and its result, so only ``write`` draws from the episode's rng (seeded by the
question); ``check`` and ``rewrite`` draw from the rng of their own prompt. Re-runs are
reproducible, and a rewrite that repeats a query meets the same review again (an identical
prompt): a teacher that ignores a review, or a reviewer that rejects a right query, keeps doing
so. The final query matches the gold rows in about 64% of episodes (two recordings of the
recipe's 2,019 training questions: 63.6%, 63.8%). A request from no known node, or a question
no template parses, still gets a plausible reply (a simple query, or a verdict from whether the
query returns rows): the policy does not raise.
"""

from __future__ import annotations

import random
import re
import sqlite3
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

SCHEMA_SQL = (Path(__file__).resolve().parent / "shop.sql").read_text()
P_WRITE = 0.50  # write: the gold query
P_CHECK = 0.85  # check: the right verdict
P_REWRITE = 0.35  # rewrite: the gold query
P_REPEAT = 0.5  # rewrite, when not fixing a wrong query: the same query again
KINDS = ("column", "filter", "aggregate", "bounds")  # write's mistakes, drawn evenly
GENERIC_REVIEW = "WRONG: the result does not answer the question."

Rows = Counter[tuple[Any, ...]]


def _connect() -> sqlite3.Connection:
    """An in-memory shop database that only allows reading."""
    conn = sqlite3.connect(":memory:")
    conn.executescript(SCHEMA_SQL)
    allowed = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION}
    conn.set_authorizer(
        lambda action, *_: sqlite3.SQLITE_OK if action in allowed else sqlite3.SQLITE_DENY
    )
    return conn


_local = threading.local()  # one read-only database per thread, built on first use


def _rows(sql: str) -> Rows | None:
    """The rows of ``sql`` as a multiset (floats to 2 decimals), or None when it fails or runs
    past its step limit."""
    if not sql.strip():
        return None
    if not hasattr(_local, "conn"):
        _local.conn = _connect()
    steps = iter(range(10_000))
    _local.conn.set_progress_handler(lambda: next(steps, None) is None, 1000)
    try:
        rows = _local.conn.execute(sql).fetchall()
    except (sqlite3.Error, sqlite3.Warning, ValueError):
        return None
    return Counter(tuple(round(v, 2) if isinstance(v, float) else v for v in r) for r in rows)


class Template(NamedTuple):
    """A question pattern, its gold SQL and its mistakes, over one value ``x``: a threshold
    (``"more 10"``: slots ``word``, ``n``, ``op``, ``flip``) or a range (``"5 12"``: ``a``, ``b``).

    ``mistakes`` maps each of :data:`KINDS` to a format string over the same slots.
    """

    name: str
    question: str
    sql: str
    pattern: re.Pattern[str]
    values: tuple[str, ...]
    mistakes: dict[str, str]

    def fill(self, x: str) -> tuple[str, str]:
        """The question and gold SQL for the value ``x``."""
        return self.question.format(**_slots(x)), self.sql.format(**_slots(x))

    def mistake(self, x: str, kind: str) -> str:
        """The SQL of mistake ``kind`` for ``x``."""
        return self.mistakes[kind].format(**_slots(x))


def _slots(x: str) -> dict[str, str]:
    """The slots of a ``cost`` value (``"more 10"``) or a range (``"5 12"``)."""
    first, second = x.split(" ", 1)
    if first in ("more", "less"):
        op, flip = (">", "<") if first == "more" else ("<", ">")
        return {"word": first, "n": second, "op": op, "flip": flip}
    return {"a": first, "b": second}


_THRESHOLDS = tuple(f"{w} {n}" for w in ("more", "less") for n in range(1, 37))
_RANGES = tuple(f"{a} {b}" for a in range(1, 40) for b in range(a + 1, 41))
_BETWEEN = "FROM products WHERE price BETWEEN {a} AND {b}"
_SWAPPED = "FROM products WHERE price BETWEEN {b} AND {a}"

TEMPLATES: tuple[Template, ...] = (
    Template(
        "between",
        "Which products cost between {a} and {b}?",
        f"SELECT name {_BETWEEN}",
        re.compile(r"Which products cost between (\d+) and (\d+)\?"),
        _RANGES,
        {
            "column": f"SELECT cost {_BETWEEN}",
            "filter": "SELECT name FROM products",
            "aggregate": f"SELECT COUNT(*) {_BETWEEN}",
            "bounds": f"SELECT name {_SWAPPED}",
        },
    ),
    Template(
        "count",
        "How many products cost between {a} and {b}?",
        f"SELECT COUNT(*) {_BETWEEN}",
        re.compile(r"How many products cost between (\d+) and (\d+)\?"),
        _RANGES,
        {
            "column": f"SELECT COUNT(cost) {_BETWEEN}",
            "filter": "SELECT COUNT(*) FROM products",
            "aggregate": f"SELECT name {_BETWEEN}",
            "bounds": f"SELECT COUNT(*) {_SWAPPED}",
        },
    ),
    Template(
        "total",
        "What is the total price of the products costing between {a} and {b}?",
        f"SELECT SUM(price) {_BETWEEN}",
        re.compile(r"What is the total price of the products costing between (\d+) and (\d+)\?"),
        _RANGES,
        {
            "column": f"SELECT SUM(cost) {_BETWEEN}",
            "filter": "SELECT SUM(price) FROM products",
            "aggregate": f"SELECT MAX(price) {_BETWEEN}",
            "bounds": f"SELECT SUM(price) {_SWAPPED}",
        },
    ),
    Template(
        "cost",
        "Which products cost {word} than {n}?",
        "SELECT name FROM products WHERE price {op} {n}",
        re.compile(r"Which products cost (more|less) than (\d+)\?"),
        _THRESHOLDS,
        {
            "column": "SELECT price FROM products WHERE price {op} {n}",
            "filter": "SELECT name FROM products",
            "aggregate": "SELECT COUNT(*) FROM products WHERE price {op} {n}",
            "bounds": "SELECT name FROM products WHERE price {flip} {n}",
        },
    ),
)


def _answered(sql: str) -> bool:
    """Whether ``sql`` runs and returns rows other than a lone NULL or zero."""
    rows = _rows(sql)
    return bool(rows) and all(v not in (None, 0) for r in rows for v in r)


def _instances(template: Template) -> list[tuple[str, str]]:
    """The (question, gold SQL) pairs of ``template`` whose gold query answers something."""
    pairs = [template.fill(x) for x in template.values]
    return [(q, sql) for q, sql in pairs if _answered(sql)]


POOL: dict[str, list[tuple[str, str]]] = {t.name: _instances(t) for t in TEMPLATES}
"""Every distinct (question, gold SQL) of each template, in a fixed order."""


# --- the teacher ------------------------------------------------------------------------------


def _parse(question: str) -> tuple[Template, str] | None:
    """The template and slot value of a templated question, or None."""
    for template in TEMPLATES:
        match = template.pattern.search(question)
        if match:
            return template, " ".join(match.groups())
    return None


def _mistake(template: Template, x: str, gold: Rows | None, kind: int) -> str:
    """Mistake number ``kind`` (of :data:`KINDS`), or the next one when it returns the gold rows."""
    for i in range(len(KINDS)):
        sql = template.mistake(x, KINDS[(kind + i) % len(KINDS)])
        if _rows(sql) != gold:
            return sql
    return template.mistake(x, "column")


def _text(content: Any) -> str:
    """The text of a message's content (a string or a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _role_and_prompt(request: dict[str, Any]) -> tuple[str, str]:
    """Which node asks (``write``, ``check`` or ``rewrite``) and the last user message."""
    messages = [m for m in request.get("messages") or [] if isinstance(m, dict)]
    system = " ".join(_text(m.get("content")) for m in messages if m.get("role") == "system")
    users = [_text(m.get("content")) for m in messages if m.get("role") == "user"]
    prompt = users[-1] if users else ""
    if "previous query was wrong" in system or "\nReview:" in prompt:
        return "rewrite", prompt
    if "You review" in system or ("\nQuery:" in prompt and "\nResult:" in prompt):
        return "check", prompt
    return "write", prompt


def _fields(prompt: str) -> tuple[str, str]:
    """The question and the query shown in a check or rewrite prompt."""
    question = re.search(r"Question:\s*(.*?)\s*(?:\nQuery:|$)", prompt, re.S)
    block = re.search(r"```(?:sql|sqlite)?\s*\n?(.*?)```", prompt, re.S | re.I)
    sql = block.group(1).strip().rstrip(";").strip() if block else ""
    return (question.group(1) if question else prompt).strip(), sql


def _sql(sql: str) -> dict[str, Any]:
    """The reply of ``write`` and ``rewrite``: the query alone in a ```sql block."""
    return {"content": f"```sql\n{sql}\n```"}


_PARTS = re.compile(r"SELECT\s+(.+?)\s+FROM\s+(.+?)(?:\s+WHERE\s+(.+))?$", re.S | re.I)


def _review(sql: str, gold_sql: str) -> str:
    """What is wrong with ``sql`` (which does not return the gold rows), naming the fix."""
    if not sql:
        return "WRONG: answer with one SELECT query."
    mine, gold = _PARTS.match(sql), _PARTS.match(gold_sql)
    if not mine or not gold:
        return GENERIC_REVIEW if _rows(sql) is not None else "WRONG: the query fails."
    select, source, where = mine.groups()
    gold_select, gold_source, gold_where = gold.groups()
    if select != gold_select:
        return f"WRONG: select {gold_select}, not {select}."
    if gold_where and not where:
        return f"WRONG: add WHERE {gold_where}."
    if where != gold_where:
        return f"WRONG: use WHERE {gold_where}."
    if source != gold_source:
        return f"WRONG: use FROM {gold_source}."
    return GENERIC_REVIEW


def _fallback_sql(question: str) -> str:
    """A plausible query for a question no template parses."""
    lower = question.lower()
    table = next((t for t in ("customer", "product", "order") if t in lower), "product")
    if lower.startswith("how many"):
        return f"SELECT COUNT(*) FROM {table}s"
    return f"SELECT {'id' if table == 'order' else 'name'} FROM {table}s"


def _write(question: str, rng: random.Random) -> dict[str, Any]:
    """``write``: the gold query, or one of the template's mistakes."""
    u_right, u_kind = rng.random(), rng.random()
    parsed = _parse(question)
    if parsed is None:
        return _sql(_fallback_sql(question))
    template, x = parsed
    gold_sql = template.fill(x)[1]
    if u_right < P_WRITE:
        return _sql(gold_sql)
    kind = int(u_kind * len(KINDS)) % len(KINDS)
    return _sql(_mistake(template, x, _rows(gold_sql), kind))


def _check(prompt: str, rng: random.Random) -> dict[str, Any]:
    """``check``: ``CORRECT`` or ``WRONG: ...``, judged against the gold rows (or not)."""
    u_right = rng.random()
    question, sql = _fields(prompt)
    rows = _rows(sql)
    parsed = _parse(question)
    if parsed is None:  # judge by whether the query runs and returns something
        ok = bool(rows)
        return {"content": "CORRECT" if ok else "WRONG: the query returns nothing or fails."}
    gold_sql = parsed[0].fill(parsed[1])[1]
    correct = rows is not None and rows == _rows(gold_sql)
    if u_right >= P_CHECK:  # the wrong verdict
        return {"content": GENERIC_REVIEW if correct else "CORRECT"}
    return {"content": "CORRECT" if correct else _review(sql, gold_sql)}


def _rewrite(prompt: str, rng: random.Random) -> dict[str, Any]:
    """``rewrite``: the gold query, the shown query again, or a fresh mistake."""
    u_fix, u_repeat, u_kind = rng.random(), rng.random(), rng.random()
    question, sql = _fields(prompt)
    parsed = _parse(question)
    if parsed is None:
        return _sql(sql or _fallback_sql(question))
    template, x = parsed
    gold_sql = template.fill(x)[1]
    gold = _rows(gold_sql)
    if u_fix < P_REWRITE:
        return _sql(gold_sql)
    if sql and _rows(sql) != gold and u_repeat < P_REPEAT:
        return _sql(sql)
    kind = int(u_kind * len(KINDS)) % len(KINDS)
    return _sql(_mistake(template, x, gold, kind))


ROLES: dict[str, Callable[[str, random.Random], dict[str, Any]]] = {
    "write": _write,
    "check": _check,
    "rewrite": _rewrite,
}


def teacher_reply(request: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The assistant message for a chat-completions ``request`` of the SQL agent's graph.

    ``write`` gets the question as its user message; ``check`` and ``rewrite`` get the question,
    the query and its result (and ``rewrite`` the review). See the module docstring for the
    policy. Never raises: anything unexpected gets a plausible reply.
    """
    role, prompt = _role_and_prompt(request)
    return ROLES[role](prompt, rng)
