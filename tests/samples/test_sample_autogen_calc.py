"""The autogen_calc sample: its AutoGen agent runs once through ``Trainer.dev`` against the
scripted fake backend (a calculator call, then the answer), and its data and tool behave."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from fake_openai_backend import FakeBackend, scripted_ids
from helpers import fake_trainer, load_sample

import voltrl as vl
from voltrl.store.memory import InMemoryStore

agent, data = load_sample("autogen_calc", "agent"), load_sample("autogen_calc", "data")


def solve_with_calculator(req: dict[str, Any]) -> dict[str, str]:
    """Call the calculator on the product in the question, then answer with its result."""
    results = [m["content"] for m in req["messages"] if m["role"] == "tool"]
    if results:
        return {"text": f"The answer is {results[-1]}."}
    question = next(m["content"] for m in req["messages"] if m["role"] == "user")
    a, b = (int(w) for w in question.split() if w.isdigit())
    return {"tool": "calculator", "arguments": json.dumps({"expression": f"{a} * {b}"})}


async def test_sample_agent_runs_once_through_dev(tmp_path: Path) -> None:
    rows = [
        {"question": "Ana has 12 boxes with 7 apples in each box. How many?", "answer": 84},
        # A wrong answer key: the agent says 27, so this rollout is rewarded 0.
        {"question": "Ben has 3 boxes with 9 cards in each box. How many?", "answer": 28},
    ]
    store = InMemoryStore()
    async with FakeBackend() as fb:
        fb.script = solve_with_calculator
        llm = vl.LLM(endpoint=fb.url, model="m")
        trainer = fake_trainer(store, tmp_path, llm, max_concurrency=2)
        result = await trainer.dev_async(agent.autogen_calc_agent, rows)

    by_answer = {r.task.input["answer"]: r for r in result.rollouts}
    assert by_answer[84].reward == 1.0 and by_answer[28].reward == 0.0
    calls = await store.get_llm_calls(by_answer[84].rollout_id)
    arguments = json.dumps({"expression": "12 * 7"})
    assert [c.response_token_ids for c in calls] == [
        scripted_ids(arguments),
        scripted_ids("The answer is 84."),
    ]
    assert {c.agent_name for c in calls} == {"solver"}
    spans = await store.get_spans(by_answer[84].rollout_id)
    [tool] = [s for s in spans if s.name == "execute_tool calculator"]
    assert tool.status == "ok" and tool.attributes["gen_ai.tool.call.result"] == "84"


def test_problems_are_reproducible_and_whole() -> None:
    rows = data.make_problems(50, seed=3)
    assert rows == data.make_problems(50, seed=3) != data.make_problems(50, seed=4)
    assert all(isinstance(r["answer"], int) and r["answer"] >= 0 for r in rows)


def test_max_number_caps_every_number_a_problem_draws() -> None:
    rows = data.make_problems(300, seed=3, max_number=20)
    assert rows == data.make_problems(300, seed=3, max_number=20) != data.make_problems(300, 3)
    for row in rows:
        question = row["question"]
        drawn = [int(n) for n in re.findall(r"\d+", question)]
        if "shares" in question:  # the total shared is each friend's share x the friends
            drawn = drawn[1:]
        if "pays with" in question:  # paid is the price x the count + the change
            drawn = drawn[:-1]
        assert max(drawn) <= 20, question
        assert isinstance(row["answer"], int) and row["answer"] >= 0


@pytest.mark.parametrize(
    ("expression", "value"), [("(3 + 4) * 5", "35"), ("7 / 2", "3.5"), ("-2 * 3", "-6")]
)
def test_calculator(expression: str, value: str) -> None:
    assert agent.calculator(expression) == value


def test_calculator_refuses_what_is_not_arithmetic() -> None:
    with pytest.raises(ValueError, match="not arithmetic"):
        agent.calculator("__import__('os')")
