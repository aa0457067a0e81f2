"""Templated questions for a CPU recipe, and a scripted, imperfect teacher for the SQL agent.

**Questions** (:func:`recipe_questions`). The 30 hand-written questions are too varied for a tiny
model trained from scratch, so the recipe uses 7 templates over the same shop database whose gold
SQL differs only by the entity or number copied from the question (rows as in
``questions.jsonl``: ``question``, ``gold_sql``, ``split``), e.g. for Emma Rossi, Green tea, 7:

- ``price``: What is the price of Green tea? ``SELECT price FROM products WHERE name = 'Green tea'``
- ``city``: Which customers live in Oslo? ``SELECT name FROM customers WHERE city = 'Oslo'``
- ``category``: List the products in category tea.
  ``SELECT name FROM products WHERE category = 'tea'``
- ``orders``: How many orders did Emma Rossi place? ``SELECT COUNT(*) FROM orders o JOIN
  customers c ON c.id = o.customer_id WHERE c.name = 'Emma Rossi'``
- ``sold``: How many Green tea were ordered in total? ``SELECT SUM(oi.quantity) FROM order_items
  oi JOIN products p ON p.id = oi.product_id WHERE p.name = 'Green tea'``
- ``cost``: Which products cost more than 10? (or less than)
  ``SELECT name FROM products WHERE price > 10``
- ``items``: How many items are in order 7?
  ``SELECT SUM(quantity) FROM order_items WHERE order_id = 7``

Values come from the database (10 products, 7 cities, 5 categories, 10 customers, 25 orders,
thresholds 1-36 kept where the answer is not empty): 134 distinct questions (:data:`POOL`), each
gold query returning a non-empty, non-NULL, non-zero answer.

**Teacher** (:func:`teacher_reply`), for ``samples/teacher_server.py``. The role of a request is
told by its system prompt (``agent.py``'s ``WRITE``, ``CHECK``, ``REWRITE``); the question is
parsed back with the templates' regexes and its gold query recomputed. Replies are short and
uniform:
``write`` and ``rewrite`` answer one ```` ```sql ```` block, ``check`` answers ``CORRECT`` or
``WRONG: <what to change>``.

- ``write`` (:data:`P_WRITE`): the gold query 50% of the time; otherwise one mistake, drawn
  evenly among a wrong column (``cost`` names no column, so that query fails), a missing
  ``WHERE`` filter, a wrong aggregate and a misspelt entity (lower-cased or a letter dropped; for
  numbers the other comparison or the next order). A mistake that happens to return the gold
  rows is replaced by the next kind.
- ``check`` (:data:`P_CHECK`): runs the query and the gold query and gives the right verdict 85%
  of the time. Its review of a wrong query names the part to change (``WRONG: select price, not
  cost.``, ``WRONG: add WHERE city = 'Oslo'.``, ``WRONG: use WHERE c.name = 'Emma Rossi'.``); a
  correct query it rejects gets ``WRONG: the result does not answer the question.``
- ``rewrite`` (:data:`P_REWRITE`): the gold query 35% of the time; otherwise the previous query
  again when it was wrong (half the time, :data:`P_REPEAT`), else a fresh mistake.

The graph's ``check`` and ``rewrite`` each send a fresh conversation whose first user message
holds the query and its result, so only ``write`` draws from the episode's rng (seeded by the
question); ``check`` and ``rewrite`` draw from the rng of their own prompt. Re-runs are
reproducible, and a rewrite that repeats a query meets the same review again (an identical
prompt): a teacher that ignores a review, or a reviewer that rejects a right query, keeps doing
so. Per call that makes ``rewrite`` fix about 25% of the wrong queries it gets. The final query
matches the gold rows in about 60% of episodes (``voltrl dev`` on three sets of 80 questions:
65%, 59%, 58%; the nominal rates of 55% / 85% / 60% would solve about 75%). A request from
no known node, or a question no template parses, still gets a plausible reply (a simple query,
or a verdict from whether the query returns rows): the policy does not raise.
"""

from __future__ import annotations

import contextlib
import random
import re
import sqlite3
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

SCHEMA_SQL = (Path(__file__).resolve().parent / "shop.sql").read_text()
P_WRITE = 0.50  # write: the gold query
P_CHECK = 0.85  # check: the right verdict
P_REWRITE = 0.35  # rewrite: the gold query
P_REPEAT = 0.5  # rewrite, when not fixing a wrong query: the same query again
KINDS = ("column", "filter", "aggregate", "entity")  # write's mistakes, drawn evenly
GENERIC_REVIEW = "WRONG: the result does not answer the question."

Rows = Counter[tuple[Any, ...]]


def _connect() -> sqlite3.Connection:
    """A fresh in-memory shop database that only allows reading, with a step limit."""
    conn = sqlite3.connect(":memory:")
    conn.executescript(SCHEMA_SQL)
    allowed = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION}
    conn.set_authorizer(
        lambda action, *_: sqlite3.SQLITE_OK if action in allowed else sqlite3.SQLITE_DENY
    )
    steps = iter(range(10_000))
    conn.set_progress_handler(lambda: next(steps, None) is None, 1000)
    return conn


def _rows(sql: str) -> Rows | None:
    """The rows of ``sql`` as a multiset (floats to 2 decimals), or None when it fails."""
    if not sql.strip():
        return None
    try:
        with contextlib.closing(_connect()) as conn:
            rows = conn.execute(sql).fetchall()
    except (sqlite3.Error, sqlite3.Warning, ValueError):
        return None
    return Counter(tuple(round(v, 2) if isinstance(v, float) else v for v in r) for r in rows)


def _column(sql: str) -> list[str]:
    """The first column of ``sql``'s rows, as text."""
    with contextlib.closing(_connect()) as conn:
        return [str(r[0]) for r in conn.execute(sql).fetchall()]


def _typo(word: str, u: float) -> str:
    """A realistic misspelling of ``word``: lower-cased, or one inner letter dropped."""
    if u < 0.4 and word.lower() != word:
        return word.lower()
    letters = [i for i in range(1, len(word) - 1) if word[i].isalpha()]
    if not letters:
        return word.lower() + "s"
    i = letters[int(u * len(letters)) % len(letters)]
    return word[:i] + word[i + 1 :]


class Template(NamedTuple):
    """A question pattern, its gold SQL and its mistakes, all over one slot ``{x}``.

    ``mistakes`` maps each of :data:`KINDS` to a format string; ``{typo}`` is a misspelt ``x``,
    ``{flip}`` the other comparison of the ``cost`` template, ``{next}`` the next number.
    """

    name: str
    question: str
    sql: str
    pattern: re.Pattern[str]
    values: tuple[str, ...]
    mistakes: dict[str, str]

    def fill(self, x: str) -> tuple[str, str]:
        """The question and gold SQL for the value ``x``."""
        return self.question.format(x=x, **_slots(x)), self.sql.format(x=x, **_slots(x))

    def mistake(self, x: str, kind: str, u: float) -> str:
        """The SQL of mistake ``kind`` for ``x``, ``u`` choosing the misspelling."""
        return self.mistakes[kind].format(x=x, typo=_typo(x, u), **_slots(x))


def _slots(x: str) -> dict[str, str]:
    """The derived slots of the ``cost`` (``"more 10"``) and ``items`` (``"7"``) values."""
    if " " in x and x.split(" ", 1)[0] in ("more", "less"):
        word, n = x.split(" ", 1)
        op, flip = (">", "<") if word == "more" else ("<", ">")
        return {"word": word, "n": n, "op": op, "flip": flip}
    if x.isdigit():
        return {"next": str(int(x) + 1)}
    return {}


_PRODUCTS = tuple(_column("SELECT name FROM products ORDER BY id"))
_CUSTOMERS = tuple(_column("SELECT name FROM customers ORDER BY id"))
_CITIES = tuple(_column("SELECT city FROM customers GROUP BY city ORDER BY MIN(id)"))
_CATEGORIES = tuple(_column("SELECT category FROM products GROUP BY category ORDER BY MIN(id)"))
_ORDERS = tuple(_column("SELECT id FROM orders ORDER BY id"))
_THRESHOLDS = tuple(f"{w} {n}" for w in ("more", "less") for n in range(1, 37))
_ORDERS_JOIN = "FROM orders o JOIN customers c ON c.id = o.customer_id"
_ITEMS_JOIN = "FROM order_items oi JOIN products p ON p.id = oi.product_id"

TEMPLATES: tuple[Template, ...] = (
    Template(
        "price",
        "What is the price of {x}?",
        "SELECT price FROM products WHERE name = '{x}'",
        re.compile(r"What is the price of (.+?)\?"),
        _PRODUCTS,
        {
            "column": "SELECT cost FROM products WHERE name = '{x}'",
            "filter": "SELECT price FROM products",
            "aggregate": "SELECT COUNT(price) FROM products WHERE name = '{x}'",
            "entity": "SELECT price FROM products WHERE name = '{typo}'",
        },
    ),
    Template(
        "city",
        "Which customers live in {x}?",
        "SELECT name FROM customers WHERE city = '{x}'",
        re.compile(r"Which customers live in (.+?)\?"),
        _CITIES,
        {
            "column": "SELECT city FROM customers WHERE city = '{x}'",
            "filter": "SELECT name FROM customers",
            "aggregate": "SELECT COUNT(*) FROM customers WHERE city = '{x}'",
            "entity": "SELECT name FROM customers WHERE city = '{typo}'",
        },
    ),
    Template(
        "category",
        "List the products in category {x}.",
        "SELECT name FROM products WHERE category = '{x}'",
        re.compile(r"List the products in category (.+?)\."),
        _CATEGORIES,
        {
            "column": "SELECT name FROM products WHERE name = '{x}'",
            "filter": "SELECT name FROM products",
            "aggregate": "SELECT COUNT(*) FROM products WHERE category = '{x}'",
            "entity": "SELECT name FROM products WHERE category = '{typo}'",
        },
    ),
    Template(
        "orders",
        "How many orders did {x} place?",
        f"SELECT COUNT(*) {_ORDERS_JOIN} WHERE c.name = '{{x}}'",
        re.compile(r"How many orders did (.+?) place\?"),
        _CUSTOMERS,
        {
            "column": f"SELECT COUNT(*) {_ORDERS_JOIN} WHERE c.city = '{{x}}'",
            "filter": f"SELECT COUNT(*) {_ORDERS_JOIN}",
            "aggregate": f"SELECT COUNT(DISTINCT c.id) {_ORDERS_JOIN} WHERE c.name = '{{x}}'",
            "entity": f"SELECT COUNT(*) {_ORDERS_JOIN} WHERE c.name = '{{typo}}'",
        },
    ),
    Template(
        "sold",
        "How many {x} were ordered in total?",
        f"SELECT SUM(oi.quantity) {_ITEMS_JOIN} WHERE p.name = '{{x}}'",
        re.compile(r"How many (.+?) were ordered in total\?"),
        _PRODUCTS,
        {
            "column": f"SELECT SUM(p.price) {_ITEMS_JOIN} WHERE p.name = '{{x}}'",
            "filter": f"SELECT SUM(oi.quantity) {_ITEMS_JOIN}",
            "aggregate": f"SELECT COUNT(*) {_ITEMS_JOIN} WHERE p.name = '{{x}}'",
            "entity": f"SELECT SUM(oi.quantity) {_ITEMS_JOIN} WHERE p.name = '{{typo}}'",
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
            "entity": "SELECT name FROM products WHERE price {flip} {n}",
        },
    ),
    Template(
        "items",
        "How many items are in order {x}?",
        "SELECT SUM(quantity) FROM order_items WHERE order_id = {x}",
        re.compile(r"How many items are in order (\d+)\?"),
        _ORDERS,
        {
            "column": "SELECT SUM(quantity) FROM order_items WHERE product_id = {x}",
            "filter": "SELECT SUM(quantity) FROM order_items",
            "aggregate": "SELECT COUNT(*) FROM order_items WHERE order_id = {x}",
            "entity": "SELECT SUM(quantity) FROM order_items WHERE order_id = {next}",
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


def recipe_questions(n: int, seed: int, *, split: str = "train") -> list[dict[str, Any]]:
    """``n`` templated questions in ``questions.jsonl``'s row format, deterministic for ``seed``.

    Templates take turns (in an order reshuffled every round), each walking through its own
    shuffled questions, so a set is balanced across templates and repeats a question only once
    its template has run out (``city`` has 7, ``category`` 5; :data:`POOL` 134 in all).
    """
    rng = random.Random(seed)
    queues: dict[str, list[tuple[str, str]]] = {name: [] for name in POOL}
    order: list[str] = []
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        if not order:
            order = list(POOL)
            rng.shuffle(order)
        name = order.pop()
        if not queues[name]:
            queues[name] = list(POOL[name])
            rng.shuffle(queues[name])
        question, sql = queues[name].pop()
        rows.append({"question": question, "gold_sql": sql, "split": split})
    return rows


# --- the teacher ------------------------------------------------------------------------------


def _parse(question: str) -> tuple[Template, str] | None:
    """The template and slot value of a templated question, or None."""
    for template in TEMPLATES:
        match = template.pattern.search(question)
        if match:
            return template, " ".join(match.groups())
    return None


def _mistake(template: Template, x: str, gold: Rows | None, kind: int, u: float) -> str:
    """Mistake number ``kind`` (of :data:`KINDS`), or the next one when it returns the gold rows."""
    for i in range(len(KINDS)):
        sql = template.mistake(x, KINDS[(kind + i) % len(KINDS)], u)
        if _rows(sql) != gold:
            return sql
    return template.mistake(x, "column", u)


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
    u_right, u_kind, u_typo = rng.random(), rng.random(), rng.random()
    parsed = _parse(question)
    if parsed is None:
        return _sql(_fallback_sql(question))
    template, x = parsed
    gold_sql = template.fill(x)[1]
    if u_right < P_WRITE:
        return _sql(gold_sql)
    kind = int(u_kind * len(KINDS)) % len(KINDS)
    return _sql(_mistake(template, x, _rows(gold_sql), kind, u_typo))


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
    u_fix, u_repeat, u_kind, u_typo = rng.random(), rng.random(), rng.random(), rng.random()
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
    return _sql(_mistake(template, x, gold, kind, u_typo))


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
