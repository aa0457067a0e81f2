"""The airline customer-service assistant: a Microsoft Agent Framework agent with the
airline's 14 tools and policy, talking to a simulated customer; only the assistant learns.

One rollout is one conversation of a task (a row from :func:`task_rows`):

1. a fresh copy of the database and the task's customer (``row["user"]``: ``"scripted"``,
   or the name of the LLM resource that plays it, e.g. ``"user_llm"``);
2. the assistant greets; then customer message → assistant turn (its tool calls, up to
   ``MAX_TOOL_ROUNDS`` model calls) → ... until the customer writes a stop token, the
   assistant transfers to a human, ``MAX_TURNS`` assistant turns pass, or a prompt outgrows
   the model's context (the backend's 400): those last two score 0, never crash;
3. the reward is :func:`scoring.evaluate`'s, and the episode's ending and score are
   recorded as an ``episode`` event in the rollout.

Both roles' calls are recorded with their agent names (``assistant``, ``user``);
``AGENT_FILTER`` keeps the user's out of the training data.
"""

from dataclasses import dataclass, field
from pathlib import Path

from agent_framework import Agent, Message
from airline_db import AirlineTask, Domain, cached_domain
from airline_tools import AirlineTools, db_copy
from customers import USER_AGENT_NAME, LLMUser, ScriptedUser, UserSimulator, stop_token
from scoring import evaluate

import voltrl as vl
from voltrl.adapters.agent_framework import chat_client, instrument
from voltrl.gateway import is_context_overflow

ASSISTANT_AGENT_NAME = "assistant"
#: The trajectory builder's agent filter: train on the assistant's calls only.
AGENT_FILTER = ASSISTANT_AGENT_NAME
GREETING = "Hi! How can I help you today?"
MAX_TURNS = 10
MAX_TOOL_ROUNDS = 6


def task_rows(data_dir: str | Path, ids: list[str], user: str = "scripted") -> list[dict]:
    """Dataset rows for ``Trainer.fit``/``dev``: the task id, where its domain lives (read
    once per worker process), and who plays the customer."""
    return [{"task_id": i, "data_dir": str(Path(data_dir).resolve()), "user": user} for i in ids]


@dataclass
class Conversation:
    """What an episode produced: the assistant's messages and how it ended."""

    assistant_texts: list[str] = field(default_factory=list)
    termination: str = ""
    turns: int = 0


def make_user(
    row: dict, resources: vl.Resources, domain: Domain, task: AirlineTask
) -> UserSimulator:
    """The customer of ``row``: scripted, or an LLM from the named resource."""
    who = row.get("user", "scripted")
    if who == "scripted":
        return ScriptedUser(task.user_scenario)
    return LLMUser(resources[who], domain.guidelines, task.user_scenario)


async def converse(assistant: Agent, user: UserSimulator, tools: AirlineTools) -> Conversation:
    """Run the conversation to its end (see the module docstring)."""
    out = Conversation()
    session = assistant.create_session()
    user_text = await user.reply(GREETING)
    turn_input: list[Message] = [Message("assistant", [GREETING]), Message("user", [user_text])]
    while True:
        if stop_token(user_text):
            out.termination = "user_stop"
            return out
        if out.turns >= MAX_TURNS:
            out.termination = "max_turns"
            return out
        try:
            response = await assistant.run(turn_input, session=session)
            out.turns += 1
            out.assistant_texts.append(response.text)
            if any(c.name == "transfer_to_human_agents" for c in tools.calls):
                out.termination = "agent_stop"
                return out
            user_text = await user.reply(response.text)
        except Exception as e:
            if not is_context_overflow(e):
                raise
            out.termination = "context_overflow"
            return out
        turn_input = [Message("user", [user_text])]


@vl.rollout
async def airline_episode(row: dict, resources: vl.Resources) -> float:
    """One conversation of task ``row["task_id"]``; the reward is tau2's (0 or 1)."""
    instrument()
    domain = cached_domain(row["data_dir"])
    task = domain.tasks[row["task_id"]]
    tools = AirlineTools(db_copy(domain.db))
    llm = resources["main_llm"]
    client = chat_client(
        llm,
        agent_name=ASSISTANT_AGENT_NAME,
        function_invocation_configuration={"max_iterations": MAX_TOOL_ROUNDS},
    )
    assistant = Agent(
        client=client,
        name=ASSISTANT_AGENT_NAME,
        instructions=domain.policy,
        tools=tools.as_functions(),
    )
    user = make_user(row, resources, domain, task)
    try:
        conversation = await converse(assistant, user, tools)
    finally:
        await user.aclose()
        await client.client.close()
    calls = [(c.name, c.arguments) for c in tools.calls]
    score = evaluate(task, domain.db, calls, conversation.assistant_texts, conversation.termination)
    vl.emit_event(
        "episode",
        task_id=task.id,
        turns=conversation.turns,
        tool_calls=len(calls),
        tool_errors=sum(c.error for c in tools.calls),
        **score.as_dict(),
    )
    return score.reward


__all__ = ["AGENT_FILTER", "USER_AGENT_NAME", "airline_episode", "task_rows"]
