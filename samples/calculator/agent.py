"""A calculator agent: an ordinary OpenAI client, one tool, several turns.

The model may call ``calculator(expression)``; the agent runs the tool, sends the result back,
and the model answers. Reward 1 when the answer's last number is the right result.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

import voltrl as vl

SYSTEM = "You are a careful assistant. Use the calculator for arithmetic."
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
MAX_TURNS = 3

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """Evaluate ``+ - *`` over integers safely; errors come back as text, as a tool would."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("unsupported expression")

    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as exc:
        return f"Error: {exc}"


def last_number(text: str | None) -> int | None:
    """The last integer in ``text``."""
    found = re.findall(r"-?\d+", text or "")
    return int(found[-1]) if found else None


@vl.rollout
async def calculator_agent(task: dict[str, Any], llm: vl.LLM) -> float:
    """Answer ``task["question"]``, using the calculator tool when the model asks for it."""
    # Not AsyncOpenAI(...): building one reads the CA certificates (50-190 ms of CPU here,
    # longer than this tiny model's whole rollout); this one shares the loop's connections.
    client = llm.openai_client(max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task["question"]},
    ]
    used_tool = False
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(
            model=llm.model, messages=messages, tools=[CALCULATOR], **llm.sampling_parameters
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            vl.emit_event("answer", used_tool=used_tool)
            return float(last_number(message.content) == int(task["answer"]))
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments)["expression"]
                result = calculate(str(expression))
            except (json.JSONDecodeError, KeyError, TypeError):
                result = 'Error: arguments must be {"expression": ...}'
            used_tool = True
            with vl.span("tool:calculator", expression=call.function.arguments) as span:
                span.attributes["result"] = result
                if result.startswith("Error"):
                    span.status = "error"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
