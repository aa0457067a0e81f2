"""An Agent Framework agent that solves arithmetic word problems with an MCP calculator.

The agent is plain Microsoft Agent Framework: an ``Agent`` on a chat-completions client, with
the calculator MCP server (``calculator_server.py``) started over stdio as its tool. VoltRL
adds two lines: ``chat_client(llm, ...)`` points the agent at the rollout's LLM, and
``instrument()`` records the framework's spans (agent run, model calls, tool calls) in the
rollout. Reward 1 when the last number of the final answer equals the expected answer.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from agent_framework import Agent, MCPStdioTool

import voltrl as vl
from voltrl.adapters.agent_framework import chat_client, instrument

SERVER = Path(__file__).resolve().with_name("calculator_server.py")
INSTRUCTIONS = (
    "Solve the math word problem. Use the calculate tool for every arithmetic step. "
    "Finish with a line 'Answer: <number>'."
)
#: Model round trips per problem (the tool loop stops after this many).
MAX_ROUND_TRIPS = 4


def calculator() -> MCPStdioTool:
    """The calculator MCP server as an Agent Framework tool (a subprocess over stdio)."""
    return MCPStdioTool(
        name="calculator",
        command=sys.executable,
        args=[str(SERVER)],
        description="An exact calculator.",
        load_prompts=False,
    )


def last_number(text: str | None) -> float | None:
    """The last number in ``text`` (``1,250`` and ``3.5`` included), or None."""
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text or "")
    return float(found[-1].replace(",", "")) if found else None


def score(text: str | None, answer: float) -> float:
    """1.0 when the last number of ``text`` is ``answer``, else 0.0."""
    value = last_number(text)
    return float(value is not None and abs(value - float(answer)) < 1e-6)


@vl.rollout
async def calc_agent(task: dict[str, Any], llm: vl.LLM) -> float:
    """Solve ``task["question"]``; the reward is whether the answer is ``task["answer"]``."""
    instrument()
    client = chat_client(
        llm,
        agent_name="solver",
        function_invocation_configuration={
            "max_iterations": MAX_ROUND_TRIPS,
            "include_detailed_errors": True,
        },
    )
    agent = Agent(client=client, name="solver", instructions=INSTRUCTIONS, tools=calculator())
    async with client.client, agent:
        response = await agent.run(task["question"])
    return score(response.text, task["answer"])
