"""``benchmarks/calculator_mistakes.py``: how the calculator samples' episodes are sorted by
kind of mistake (its end-to-end use on a real recipe run is in ``test_learning_recipes.py``)."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT

from voltrl.types import LLMCall

QUESTION = "Ana has 12 boxes with 7 apples in each box. How many apples is that?"


@pytest.fixture(autouse=True)
def _benchmarks_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))


def call(expression: str | None, content: str | None = None) -> LLMCall:
    """A recorded call whose reply calls the calculator with ``expression`` (or answers)."""
    tool_calls = (
        []
        if expression is None
        else [
            {
                "id": "c1",
                "type": "function",
                "function": {
                    "name": "calculator",
                    "arguments": json.dumps({"expression": expression}),
                },
            }
        ]
    )
    message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
    return LLMCall(rollout_id="ro", attempt_id="at", response={"choices": [{"message": message}]})


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        (None, "no calculator"),
        ("12 * 7", "right"),
        ("12 * 8", "copied wrong"),  # 8 is not in the problem
        ("1 * 7", "copied wrong"),  # a digit dropped
        ("12 + 7", "wrong operator or term"),
        ("12", "wrong operator or term"),
        ("12 *", "not arithmetic"),
        ("", "not arithmetic"),
    ],
)
def test_an_episode_is_sorted_by_its_last_calculator_expression(expression, expected):
    from calculator_mistakes import kind

    assert kind(QUESTION, 84, expression) == expected


def test_the_last_calculator_call_of_the_episode_decides():
    from calculator_mistakes import last_expression

    assert last_expression([call("12 + 7"), call("12 * 7"), call(None, "84")]) == "12 * 7"
    assert last_expression([call(None, "84")]) is None
    broken = call("x")
    broken.response["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = "{oops"
    assert last_expression([broken]) == ""


def test_a_run_that_is_not_a_calculator_samples_is_refused_by_name(tmp_path):
    import asyncio

    from calculator_mistakes import kinds_by_validation

    from voltrl.store.sql import SQLStore
    from voltrl.types import Task

    async def store_with(tasks: list[dict]) -> None:
        store = SQLStore(tmp_path / "store.sqlite")
        try:
            await store.enqueue([Task(input=t) for t in tasks], mode="val")
        finally:
            await store.close()

    asyncio.run(store_with([]))
    with pytest.raises(ValueError, match="has no validation episodes"):
        asyncio.run(kinds_by_validation(tmp_path))
    asyncio.run(store_with([{"question": "Which products cost between 5 and 12?"}]))
    with pytest.raises(ValueError, match="not calculator problems"):
        asyncio.run(kinds_by_validation(tmp_path))
