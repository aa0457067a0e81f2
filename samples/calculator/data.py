"""Arithmetic tasks for the calculator agent, and warm-up transcripts that teach the format.

The warm-up shows two behaviours: call the calculator and answer with its result
("The answer is ..."), or answer straight away ("I think it is ..."). Both transcripts carry
the right answer, so the warm-up prefers neither; only the model's own (poor) mental
arithmetic makes answering directly worse. RL has to find out that calling the tool pays.
"""

from __future__ import annotations

import json
import random
from typing import Any

from agent import CALCULATOR, SYSTEM, calculate

OPS = ("+", "-", "*")


def make_tasks(n: int, seed: int, *, low: int = 2, high: int = 99) -> list[dict[str, Any]]:
    """``n`` questions ``What is a OP b?`` with their answers, reproducible from ``seed``."""
    rng = random.Random(seed)
    tasks = []
    for _ in range(n):
        a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(OPS)
        tasks.append(
            {"question": f"What is {a} {op} {b}?", "answer": int(calculate(f"{a}{op}{b}"))}
        )
    return tasks


def warmup_conversations(
    tasks: list[dict[str, Any]], seed: int, p_tool: float = 0.5
) -> list[dict[str, Any]]:
    """One transcript per task: a tool-using one with probability ``p_tool``, else direct."""
    rng = random.Random(seed)
    out = []
    for i, task in enumerate(tasks):
        expression = task["question"].removeprefix("What is ").removesuffix("?")
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task["question"]},
        ]
        if rng.random() < p_tool:
            answer = f"The answer is {task['answer']}."
            call_id = f"call_{i}"
            arguments = json.dumps({"expression": expression})
            messages += [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": "calculator", "arguments": arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call_id, "content": str(task["answer"])},
            ]
        else:
            answer = f"I think it is {task['answer']}."
        messages.append({"role": "assistant", "content": answer})
        out.append({"messages": messages, "tools": [CALCULATOR]})
    return out
