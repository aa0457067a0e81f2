"""The simulated customer: an LLM playing the scenario (``LLMUser``), or a deterministic
script of it (``ScriptedUser``, for tests and CPU runs).

Both answer the assistant's text (never its tool calls) with the customer's next message,
and end the conversation by writing ``###STOP###``, ``###TRANSFER###`` or
``###OUT-OF-SCOPE###``.
"""

import re
from typing import Any, Protocol

from agent_framework import Agent

import voltrl as vl
from voltrl.adapters.agent_framework import chat_client

#: Agent name of the simulator's calls (recorded, never trained: see agent.AGENT_FILTER).
USER_AGENT_NAME = "user"


class UserSimulator(Protocol):
    """What the episode needs from a customer."""

    async def reply(self, assistant_text: str) -> str:
        """The customer's answer to the assistant's message."""
        ...

    async def aclose(self) -> None:
        """Release what the simulator holds."""
        ...


class LLMUser:
    """A customer played by an LLM (an Agent Framework agent on ``llm``, agent name
    ``user``) under tau2's user-simulator system ``prompt`` (the simulation
    guidelines and the task's scenario)."""

    def __init__(self, llm: vl.LLM, prompt: str) -> None:
        self.client = chat_client(llm, agent_name=USER_AGENT_NAME)
        self.agent = Agent(client=self.client, name=USER_AGENT_NAME, instructions=prompt)
        self.session = self.agent.create_session()

    async def reply(self, assistant_text: str) -> str:
        """The model's next customer message."""
        response = await self.agent.run(assistant_text, session=self.session)
        return response.text

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self.client.client.close()


def first_person(text: str) -> str:
    """The scenario's second-person text as the customer says it ("Your user id is x" →
    "My user id is x")."""
    for pattern, repl in (
        (r"\bYou are\b", "I am"),
        (r"\byou are\b", "I am"),
        (r"\bYour\b", "My"),
        (r"\byour\b", "my"),
        (r"\bYou\b", "I"),
        (r"\byou\b", "I"),
        (r"\byourself\b", "myself"),
    ):
        text = re.sub(pattern, repl, text)
    return text


CONFIRMATION_CUES = ("confirm", "proceed", "shall i", "would you like me", "yes or no", "(yes/no)")


class ScriptedUser:
    """A deterministic customer following the known facts of a tau2 task's ``user_scenario``
    (its instructions: tau2's structured ones, or free text) and these stop rules:

    1. answers the greeting with the reason for the call and everything it knows;
    2. answers a request for confirmation with yes (at most ``max_confirmations`` times);
    3. answers a question about its ids by repeating what it knows (once);
    4. otherwise thanks the agent and stops (``###STOP###``); also after ``max_turns``.
    """

    def __init__(self, scenario: Any, max_confirmations: int = 2, max_turns: int = 8):
        self.instructions = scenario.instructions
        self.max_confirmations = max_confirmations
        self.max_turns = max_turns
        self.turns = self.confirmations = 0
        self.repeated = False

    def _known(self) -> str:
        ins = self.instructions
        if isinstance(ins, str):
            return ""
        return first_person(ins.known_info or "")

    def opening(self) -> str:
        """The first message: why the customer calls, and what they know."""
        ins = self.instructions
        if isinstance(ins, str):
            return first_person(ins.strip().split("\n")[0])
        return " ".join(p for p in (first_person(ins.reason_for_call), self._known()) if p)

    async def reply(self, assistant_text: str) -> str:
        """The next message, by the rules above."""
        self.turns += 1
        text = assistant_text.lower()
        if self.turns == 1:
            return self.opening()
        if self.turns > self.max_turns:
            return "###STOP###"
        if "human agent" in text and "transfer" in text:
            return "###TRANSFER###"
        asks_to_confirm = "?" in text and any(c in text for c in CONFIRMATION_CUES)
        if asks_to_confirm and self.confirmations < self.max_confirmations:
            self.confirmations += 1
            return "Yes, please go ahead."
        if "?" in text and ("user id" in text or "reservation" in text) and not self.repeated:
            self.repeated = True
            return self._known() or "I don't know that."
        return "Thank you, that's all. ###STOP###"

    async def aclose(self) -> None:
        """Nothing to release."""
