"""The airline customer-service assistant: a Microsoft Agent Framework agent with the
airline's 14 tools and policy, talking to a simulated customer by tau2's rules; only the
assistant learns.

One rollout is one conversation of a task (a row from :func:`task_rows`) of tau2's own airline
domain, from tau2's package (:mod:`tau2_domain`): its tasks, its tools on its environment, its
prompts, its rules and its evaluator.

The conversation follows tau2's orchestrator, one message at a time:

1. the assistant's greeting goes to the customer (``row["user"]``: the name of the LLM
   resource that plays it, e.g. ``"user_llm"``, or ``"scripted"``);
2. each customer message goes to the assistant; each assistant message with tool calls goes
   to the tools (results back to the assistant), one without goes to the customer. Every
   message is a step; a batch of tool results is one step;
3. it ends when the customer writes a stop token (``user_stop``), after ``max_steps`` steps
   (``max_steps``) or ``max_errors`` tool errors (``too_many_errors``), on an empty message
   (``agent_error``/``user_error``, where tau2's run fails the simulation), or when a prompt
   outgrows the model's context (``context_overflow``, ours: tau2 would fail it too).
   Limits are checked after every step not bound for the tools, and win over a stop token
   in the same step, as in tau2.

The reward is tau2's evaluator's; the ending and the score are an ``episode`` event.
Both roles' calls are recorded with their agent names (``assistant``, ``user``);
``AGENT_FILTER`` keeps the user's out of the training data.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import tau2_domain
from agent_framework import Agent, Content, FunctionTool, Message
from customers import USER_AGENT_NAME, LLMUser, ScriptedUser, UserSimulator
from tau2_domain import Tau2Tools

import voltrl as vl
from voltrl.adapters.agent_framework import chat_client, instrument
from voltrl.gateway import is_context_overflow

ASSISTANT_AGENT_NAME = "assistant"
#: The trajectory builder's agent filter: train on the assistant's calls only.
AGENT_FILTER = ASSISTANT_AGENT_NAME


@dataclass(frozen=True)
class Rules:
    """How a conversation may go: tau2's limits (``tau2.config``'s defaults), its first
    message and its user's stop tokens (:func:`tau2_domain.rules`)."""

    max_steps: int
    max_errors: int
    greeting: str
    user_stop_tokens: tuple[str, ...]

    @classmethod
    def tau2(cls) -> Rules:
        """tau2's rules, read from tau2's package."""
        return cls(**tau2_domain.rules())

    def user_stopped(self, text: str) -> bool:
        """Whether the customer's message ends the conversation."""
        return any(t in text for t in self.user_stop_tokens)


@dataclass
class Episode:
    """What a conversation produced: its messages in OpenAI form (an assistant message's
    ``tool_calls`` hold ``id``, ``name``, ``arguments`` as a dict, and ``executed``; a tool
    message has ``error`` and ``executed``), how it ended, its steps and tool errors."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    termination: str = ""
    steps: int = 0
    errors: int = 0

    @property
    def tool_calls(self) -> list[tuple[str, dict[str, Any]]]:
        """The tool calls that reached the tools, in order, as ``(name, arguments)``."""
        return [
            (c["name"], c["arguments"])
            for m in self.messages
            if m["role"] == "assistant"
            for c in m.get("tool_calls") or ()
            if c["executed"]
        ]


def task_rows(ids: list[str], user: str = "user_llm") -> list[dict[str, Any]]:
    """Dataset rows for ``Trainer.fit``/``dev``: the id of one of tau2's airline tasks, and
    who plays the customer (an LLM resource's name, or ``"scripted"``)."""
    return [{"task_id": str(i), "user": user} for i in ids]


def task_ids(split: str) -> list[str]:
    """The ids of tau2's ``split``: ``base`` (all 50 tasks), ``train`` (30) or ``test`` (20)."""
    return list(tau2_domain.tasks(split))


def declarations(toolbox: Tau2Tools) -> list[FunctionTool]:
    """The tools as Agent Framework declarations: the model sees them, the episode runs them."""
    return [
        FunctionTool(
            name=s["function"]["name"],
            description=s["function"].get("description", ""),
            input_model=s["function"]["parameters"],
        )
        for s in toolbox.schemas()
    ]


def run_tool(
    toolbox: Tau2Tools, call: Content, call_id: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run one of the model's function calls: its record in the assistant's message and the
    tool message with the result. Arguments that are not a JSON object never reach the tools
    (the model gets an error; both records say ``executed: False``)."""
    raw = call.arguments
    if isinstance(raw, str):
        try:
            arguments = json.loads(raw.strip() or "{}")
        except ValueError:
            arguments = None
    else:
        arguments = dict(raw or {})
    executed = isinstance(arguments, dict)
    record = {"id": call_id, "name": call.name, "arguments": arguments if executed else {}}
    if not executed:
        result, error = f"Error: the arguments of {call.name} are not a JSON object: {raw}", True
    else:
        with vl.span(f"execute_tool {call.name}", tool=call.name, arguments=arguments) as span:
            result, error = toolbox.call(call_id, call.name, arguments)
            span.attributes.update(result=result, error=error)
    answer = {"role": "tool", "tool_call_id": call_id, "content": result, "error": error}
    return {**record, "executed": executed}, {**answer, "executed": executed}


async def converse(
    assistant: Agent, user: UserSimulator, toolbox: Tau2Tools, rules: Rules
) -> Episode:
    """Run the conversation to its end (see the module docstring)."""
    ep = Episode(messages=[{"role": "assistant", "content": rules.greeting}])
    session = assistant.create_session()
    pending: list[Message] = [Message("assistant", [rules.greeting])]
    text, to_user = rules.greeting, True
    while not ep.termination:
        try:
            if to_user:
                text = await user.reply(text)
                ep.steps += 1
                ep.messages.append({"role": "user", "content": text})
                pending.append(Message("user", [text]))
                if not text.strip():
                    ep.termination = "user_error"
                elif rules.user_stopped(text):
                    ep.termination = "user_stop"
                to_user = False
            else:
                response = await assistant.run(pending, session=session)
                ep.steps += 1
                text, pending = response.text, []
                calls = [c for m in response.messages for c in m.contents]
                calls = [c for c in calls if c.type == "function_call"]
                message: dict[str, Any] = {"role": "assistant", "content": text}
                ep.messages.append(message)
                if calls:
                    message["tool_calls"] = []
                    for i, call in enumerate(calls):
                        call_id = call.call_id or f"call_{ep.steps}_{i}"
                        record, answer = run_tool(toolbox, call, call_id)
                        message["tool_calls"].append(record)
                        ep.messages.append(answer)
                        ep.errors += answer["error"]
                        result = Content.from_function_result(
                            call_id=call_id, result=answer["content"]
                        )
                        pending.append(Message("tool", [result]))
                    ep.steps += 1  # the tool results: one step in tau2
                elif not text.strip():
                    ep.termination = "agent_error"
                else:
                    to_user = True
        except Exception as e:
            if not is_context_overflow(e):
                raise
            ep.termination = "context_overflow"
            return ep
        if ep.steps >= rules.max_steps:
            ep.termination = "max_steps"
        if ep.errors >= rules.max_errors:
            ep.termination = "too_many_errors"
    return ep


@dataclass
class Setup:
    """One episode's task: tau2's ``Task``, the assistant's instructions and tools (on a fresh
    tau2 environment), the customer's system prompt, and the rules."""

    task: Any
    toolbox: Tau2Tools
    instructions: str
    user_prompt: str
    rules: Rules

    def score(self, ep: Episode) -> dict[str, Any]:
        """tau2's verdict on ``ep``: ``reward``, ``termination`` and its parts."""
        return tau2_domain.evaluate(self.task, ep.messages, ep.termination)


def setup(row: dict[str, Any]) -> Setup:
    """tau2's task ``row["task_id"]`` on a fresh tau2 environment."""
    task = tau2_domain.task(row["task_id"])
    if task.initial_state is not None:  # none of tau2's 50 airline tasks has one
        raise ValueError(f"tau2 task {task.id} starts from an initial_state: not supported")
    tools = Tau2Tools()
    return Setup(
        task=task,
        toolbox=tools,
        instructions=tau2_domain.assistant_prompt(tools.policy),
        user_prompt=tau2_domain.user_prompt(task.user_scenario),
        rules=Rules.tau2(),
    )


def make_user(row: dict[str, Any], resources: vl.Resources, s: Setup) -> UserSimulator:
    """The customer of ``row``: scripted, or an LLM from the named resource."""
    who = row["user"]
    if who == "scripted":
        return ScriptedUser(s.task.user_scenario)
    if who not in resources:
        raise KeyError(f"the customer's LLM resource {who!r} is not among {sorted(resources)}")
    return LLMUser(resources[who], s.user_prompt)


@vl.rollout
async def airline_episode(row: dict, resources: vl.Resources) -> float:
    """One conversation of tau2's task ``row["task_id"]``; the reward is tau2's (0 or 1)."""
    instrument()
    s = await asyncio.to_thread(setup, row)  # tau2 reads its database (~0.5 s of CPU)
    client = chat_client(
        resources["main_llm"],
        agent_name=ASSISTANT_AGENT_NAME,
        function_invocation_configuration={"enabled": False},  # the episode runs the tools
    )
    assistant = Agent(
        client=client,
        name=ASSISTANT_AGENT_NAME,
        instructions=s.instructions,
        tools=declarations(s.toolbox),
    )
    user = make_user(row, resources, s)
    try:
        ep = await converse(assistant, user, s.toolbox, s.rules)
    finally:
        await user.aclose()
        await client.client.close()
    score = await asyncio.to_thread(s.score, ep)  # tau2's evaluator replays the episode
    vl.emit_event(
        "episode",
        task_id=row["task_id"],
        steps=ep.steps,
        tool_calls=len(ep.tool_calls),
        tool_errors=ep.errors,
        **score,
    )
    return score["reward"]


__all__ = ["AGENT_FILTER", "USER_AGENT_NAME", "airline_episode", "task_rows"]
