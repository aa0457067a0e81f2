"""A LangGraph SQL agent: write → execute → check → rewrite, on the shop database in ``shop.sql``.

``write`` turns the question into a SQLite query, ``execute`` runs it, ``check`` reviews the
query and its result, and ``rewrite`` fixes the query from the review until ``check`` says
``CORRECT`` or the agent has written ``MAX_TURNS`` queries. One LangChain model serves the three
LLM nodes; each call is recorded under its node's name, so training can optimise ``write`` and
``rewrite`` only (``AGENT_FILTER``). Reward: 1 when the final query returns the same rows as the
gold query (order and float noise aside), else 0.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph

import voltrl as vl
from voltrl.adapters.langchain import chat_model, tracing_config

HERE = Path(__file__).resolve().parent
SCHEMA_SQL = (HERE / "shop.sql").read_text()
QUESTIONS = HERE / "questions.jsonl"
AGENT_FILTER = "write|rewrite"  # the agents whose calls are trained on
MAX_TURNS = 3  # queries written per question: the first and up to two rewrites
MAX_ROWS = 20  # rows shown to the checker
MAX_STEPS = 10_000  # thousands of SQLite VM steps before a query is aborted

TABLES = {  # table name -> its CREATE TABLE statement
    line.split()[2]: line for line in SCHEMA_SQL.splitlines() if line.startswith("CREATE TABLE")
}
SCHEMA = "\n".join(TABLES.values())
WRITE = (
    "You write SQLite queries for this database:\n{schema}\n"
    "Answer with exactly one SELECT query in a ```sql code block and nothing else."
)
CHECK = (
    "You review SQLite queries. Given a question, a query and its result, reply CORRECT if the "
    "query answers the question; otherwise say briefly what is wrong."
)
REWRITE = WRITE + "\nThe previous query was wrong: fix it using the review."


class SQLState(TypedDict):
    """What flows through the graph."""

    question: str
    sql: str
    result: str
    failed: bool
    review: str
    turns: int
    done: bool


def connect() -> sqlite3.Connection:
    """A fresh in-memory copy of the shop database that only allows reading."""
    conn = sqlite3.connect(":memory:")
    conn.executescript(SCHEMA_SQL)
    allowed = {
        sqlite3.SQLITE_SELECT,
        sqlite3.SQLITE_READ,
        sqlite3.SQLITE_FUNCTION,
        sqlite3.SQLITE_RECURSIVE,
    }
    conn.set_authorizer(
        lambda action, *_: sqlite3.SQLITE_OK if action in allowed else sqlite3.SQLITE_DENY
    )
    steps = iter(range(MAX_STEPS))
    conn.set_progress_handler(lambda: next(steps, None) is None, 1000)
    return conn


def run_sql(sql: str) -> tuple[list[tuple[Any, ...]], list[str]]:
    """Rows and column names of ``sql``; ``sqlite3.Error`` when it fails or is not allowed."""
    with contextlib.closing(connect()) as conn:
        cursor = conn.execute(sql)
        rows = cursor.fetchall()
        return rows, [d[0] for d in cursor.description or []]


def extract_sql(text: str) -> str:
    """The query in a model reply: a ```sql block, else any ``` block, else from SELECT on."""
    block = re.search(r"```(?:sql|sqlite)?\s*\n?(.*?)```", text, re.S | re.I)
    if block:
        return block.group(1).strip().rstrip(";").strip()
    select = re.search(r"\b(SELECT|WITH)\b.*", text, re.S | re.I)
    return select.group(0).split(";")[0].strip() if select else ""


def _normalized(rows: list[tuple[Any, ...]]) -> Counter[tuple[Any, ...]]:
    return Counter(tuple(round(v, 2) if isinstance(v, float) else v for v in r) for r in rows)


def execution_match(sql: str, gold_sql: str) -> float:
    """1.0 when ``sql`` returns the gold query's rows (as a multiset), else 0.0."""
    if not sql:
        return 0.0
    try:
        rows, _ = run_sql(sql)
    except sqlite3.Error:
        return 0.0
    gold, _ = run_sql(gold_sql)
    return float(_normalized(rows) == _normalized(gold))


def schema_for(tables: Sequence[str] | None = None) -> str:
    """The schema the prompts show: every table's ``CREATE TABLE``, or only those of ``tables``
    (a pruned schema, as text-to-SQL pipelines give a question its relevant tables; one name
    may be given as a string). The database itself keeps every table."""
    if tables is None:
        return SCHEMA
    if isinstance(tables, str):
        tables = [tables]
    unknown = sorted(set(tables) - set(TABLES))
    if unknown or not tables:
        raise ValueError(f"task 'tables' must name some of {sorted(TABLES)}; got {list(tables)}")
    return "\n".join(line for name, line in TABLES.items() if name in tables)


def _show(state: SQLState) -> str:
    query = f"```sql\n{state['sql']}\n```"
    return f"Question: {state['question']}\nQuery:\n{query}\nResult:\n{state['result']}"


def build_graph(model: BaseChatModel, schema: str = SCHEMA) -> Any:
    """The compiled write → execute → check → rewrite graph around ``model``; ``write`` and
    ``rewrite`` show ``schema``."""

    async def write(state: SQLState) -> dict[str, Any]:
        reply = await model.ainvoke(
            [SystemMessage(WRITE.format(schema=schema)), HumanMessage(state["question"])]
        )
        return {"sql": extract_sql(str(reply.content)), "turns": 1}

    def execute(state: SQLState) -> dict[str, Any]:
        if not state["sql"]:
            return {"result": "Error: no SQL query found in the reply.", "failed": True}
        try:
            rows, columns = run_sql(state["sql"])
        except sqlite3.Error as exc:
            return {"result": f"Error: {exc}", "failed": True}
        lines = [" | ".join(columns)] + [" | ".join(map(str, r)) for r in rows[:MAX_ROWS]]
        more = f"\n... ({len(rows)} rows)" if len(rows) > MAX_ROWS else ""
        return {"result": "\n".join(lines) + more, "failed": False}

    async def check(state: SQLState) -> dict[str, Any]:
        reply = await model.ainvoke([SystemMessage(CHECK), HumanMessage(_show(state))])
        review = str(reply.content)
        correct = re.match(r"\s*\**CORRECT\b", review) is not None and not state["failed"]
        return {"review": review, "done": correct}

    async def rewrite(state: SQLState) -> dict[str, Any]:
        prompt = f"{_show(state)}\nReview: {state['review']}"
        reply = await model.ainvoke(
            [SystemMessage(REWRITE.format(schema=schema)), HumanMessage(prompt)]
        )
        return {"sql": extract_sql(str(reply.content)), "turns": state["turns"] + 1}

    def after_check(state: SQLState) -> str:
        return END if state["done"] or state["turns"] >= MAX_TURNS else "rewrite"

    graph = StateGraph(SQLState)
    graph.add_node("write", write)
    graph.add_node("execute", execute)
    graph.add_node("check", check)
    graph.add_node("rewrite", rewrite)
    graph.add_edge(START, "write")
    graph.add_edge("write", "execute")
    graph.add_edge("execute", "check")
    graph.add_conditional_edges("check", after_check, ["rewrite", END])
    graph.add_edge("rewrite", "execute")
    return graph.compile()


@vl.rollout
async def sql_agent(task: dict[str, Any], llm: vl.LLM) -> float:
    """Answer ``task["question"]`` with SQL; reward = execution match with ``task["gold_sql"]``.

    ``task["tables"]`` (optional) lists the tables the prompts show (default: all)."""
    model = chat_model(llm)  # its calls are named after the node making them
    graph = build_graph(model, schema_for(task.get("tables")))
    start: SQLState = {
        "question": task["question"],
        "sql": "",
        "result": "",
        "failed": False,
        "review": "",
        "turns": 0,
        "done": False,
    }
    final = await graph.ainvoke(start, config=tracing_config({"recursion_limit": 4 * MAX_TURNS}))
    return execution_match(final["sql"], task["gold_sql"])
