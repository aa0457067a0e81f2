"""An AutoGen ``AssistantAgent`` with a calculator tool, solving arithmetic word problems.

The agent is ordinary AutoGen code; VoltRL adds one line: the model client comes from the
rollout's LLM (``model_client``), which also records AutoGen's spans (the agent step, each
calculator call with its result or error) into the rollout. Reward 1 when the last number of
the agent's final message is the answer.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.base import TaskResult
from autogen_core.models import ChatCompletionClient

import voltrl as vl
from voltrl.adapters.autogen import model_client

SYSTEM = (
    "You solve arithmetic word problems. Use the calculator tool for every computation, "
    "then reply with the final number only."
)
MAX_TOOL_ROUNDS = 3

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses, e.g. "(3 + 4) * 5"."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    value = ev(ast.parse(expression.strip(), mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def final_text(result: TaskResult) -> str:
    """The text of the agent's last message."""
    for message in reversed(result.messages):
        content = getattr(message, "content", None)
        if isinstance(content, str):
            return content
    return ""


def score(text: str, answer: int) -> float:
    """1.0 when the last number in ``text`` equals ``answer``, else 0.0."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return float(bool(numbers) and float(numbers[-1]) == answer)


def build_agent(client: ChatCompletionClient) -> AssistantAgent:
    """The AutoGen agent: one tool, up to three rounds of tool calls, then an answer."""
    return AssistantAgent(
        "solver",
        model_client=client,
        tools=[calculator],
        system_message=SYSTEM,
        max_tool_iterations=MAX_TOOL_ROUNDS,
    )


@vl.rollout
async def autogen_calc_agent(task: dict[str, Any], llm: vl.LLM) -> float:
    """Solve ``task["question"]``; reward 1 for the right final number."""
    client = model_client(llm, agent_name="solver")
    try:
        result = await build_agent(client).run(task=task["question"])
    finally:
        await client.close()
    return score(final_text(result), int(task["answer"]))
