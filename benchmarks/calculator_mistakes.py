"""What the calculator samples' students get wrong: their held-out episodes by kind of mistake,
after the warm-up (first validation) and after RL (last validation) of a recipe run.

    python benchmarks/calculator_mistakes.py runs/autogen_calc-recipe-seed0 [RUN_DIR ...]

Each episode of ``autogen_calc`` or ``calc_mcp`` is sorted by its last calculator call (the
run's store keeps every call's arguments): no calculator call; an expression whose value is
the answer; a wrong expression with a number that is not in the problem (a number copied
wrong: a digit changed or dropped); a wrong expression of the problem's numbers (a wrong
operator, a term left out); or one the calculator cannot evaluate. The last column is the share
of right expressions among the episodes that called the calculator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "samples"))

from arithmetic_teacher import evaluate  # noqa: E402

from voltrl.store.sql.store import SQLStore  # noqa: E402

KINDS = ("no calculator", "right", "copied wrong", "wrong operator or term", "not arithmetic")


def last_expression(calls: list[Any]) -> str | None:
    """The ``expression`` argument of the episode's last calculator call, if any."""
    expression = None
    for call in calls:
        message = ((call.response.get("choices") or [{}])[0]).get("message") or {}
        for tool_call in message.get("tool_calls") or []:
            arguments = (tool_call.get("function") or {}).get("arguments")
            try:
                parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                parsed = None
            expression = str(parsed.get("expression")) if isinstance(parsed, dict) else ""
    return expression


def kind(question: str, answer: float, expression: str | None) -> str:
    """The kind of one episode (one of :data:`KINDS`)."""
    if expression is None:
        return "no calculator"
    try:
        value = evaluate(expression)
    except (ValueError, SyntaxError, RecursionError):
        return "not arithmetic"
    if abs(value - answer) < 1e-6:
        return "right"
    in_problem = set(re.findall(r"\d+", question))
    copied = all(n in in_problem for n in re.findall(r"\d+", expression))
    return "wrong operator or term" if copied else "copied wrong"


async def kinds_by_validation(run_dir: Path) -> dict[int, Counter[str]]:
    """For the first and the last validation of the run: how many episodes of each kind."""
    store = SQLStore(run_dir / "store.sqlite")
    try:
        rollouts = await store.query_rollouts(mode="val")
        if not rollouts:
            raise ValueError(f"{run_dir} has no validation episodes")
        if any({"question", "answer"} - set(r.task.input) for r in rollouts):
            raise ValueError(f"{run_dir}: its tasks are not calculator problems (question, answer)")
        by_version: dict[int, list[Any]] = {}
        for r in rollouts:
            by_version.setdefault(r.resources_version or 0, []).append(r)
        out: dict[int, Counter[str]] = {}
        for version in sorted({min(by_version), max(by_version)}):
            counts: Counter[str] = Counter()
            for r in by_version[version]:
                calls = await store.get_llm_calls(r.rollout_id, r.final_attempt_id)
                question, answer = r.task.input["question"], float(r.task.input["answer"])
                counts[kind(question, answer, last_expression(calls))] += 1
            out[version] = counts
        return out
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="recipe run directories")
    args = parser.parse_args()
    for run_dir in args.run_dirs:
        if not (run_dir / "store.sqlite").exists():
            parser.error(f"{run_dir} has no store.sqlite: give a recipe run's directory")
    print("| run | validation | " + " | ".join(KINDS) + " | right among calculator calls |")
    print("|---|---|" + "---|" * (len(KINDS) + 1))
    for run_dir in args.run_dirs:
        try:
            by_version = asyncio.run(kinds_by_validation(run_dir))
        except ValueError as e:
            sys.exit(f"error: {e}")
        for label, counts in zip(("after warm-up", "after RL"), by_version.values(), strict=False):
            called = sum(counts.values()) - counts["no calculator"]
            share = f"{counts['right'] / called:.0%}" if called else "-"
            cells = " | ".join(str(counts[k]) for k in KINDS)
            print(f"| {run_dir.name} | {label} | {cells} | {share} |")


if __name__ == "__main__":
    main()
