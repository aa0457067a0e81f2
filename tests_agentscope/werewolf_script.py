"""Scripted werewolf players for the tests: a backend script that reads who is asked what
from each request and answers a legal move (or the move a test chose), and helpers that read
the requests back (who was asked what, what they had heard, their pinned note)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fake_openai_backend import FakeBackend
from helpers import fake_trainer, load_sample

import voltrl as vl
from voltrl.store.memory import InMemoryStore

agent = load_sample("werewolf", "agent")
import rules  # noqa: E402  (the sample's directory is on sys.path now)

Choose = Callable[[str, str, str, list[str]], str | None]
"""``(player, role, prompt, choices)`` → the answer to give, or None for the first choice."""


def choices_offered(req: dict[str, Any]) -> list[str] | None:
    """The legal answers of a structured-output request (the schema's enum), else None."""
    for tool in req.get("tools") or ():
        if tool["function"]["name"] == "GenerateStructuredOutput":
            return tool["function"]["parameters"]["properties"]["target"]["enum"]
    return None


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content)
    return content or ""


def system_prompt(req: dict[str, Any]) -> str:
    """The request's system prompt (the rules, the role, the pinned note)."""
    return _text(req["messages"][0])


def player_of(req: dict[str, Any]) -> str:
    """Who is asked."""
    return system_prompt(req).split("You are ")[1].split(";")[0]


def role_of(req: dict[str, Any]) -> str:
    """The asked player's role."""
    return system_prompt(req).split("your role is ")[1].split(".")[0]


def pack_of(req: dict[str, Any]) -> set[str]:
    """The asked werewolf and the others its system prompt names (empty for the village)."""
    text = system_prompt(req)
    if "The other werewolves are " not in text:
        return set()
    mates = text.split("The other werewolves are ")[1].split(".")[0]
    return {player_of(req), *mates.split(", ")}


def heard(req: dict[str, Any]) -> str:
    """Everything in the asked player's history (the multi-agent formatter's ``<history>``)."""
    return "\n".join(_text(m) for m in req["messages"][1:] if "<history>" in _text(m))


def prompt_of(req: dict[str, Any]) -> str:
    """The moderator's question this request answers (the last line the moderator said)."""
    return heard(req).rsplit("moderator: ", 1)[-1].split("\n</history>")[0]


def legal(invalid_from: str | None = None, choose: Choose | None = None):
    """A script playing legal moves: ``choose``'s answer, else the first choice offered
    ("save" before "pass", "nobody" before a poison, "agree" before "talk on"; the
    werewolves bite the first player not of their pack); speeches name the speaker.
    ``invalid_from``: that player's every answer is outside the choices."""

    def script(req: dict[str, Any]) -> dict[str, str]:
        options = choices_offered(req)
        player = player_of(req)
        if options is None:
            return {"text": f"I am {player} and I trust nobody."}
        picked = choose(player, role_of(req), prompt_of(req), options) if choose else None
        if picked is None and "vote whom to kill" in prompt_of(req):
            picked = next(x for x in options if x not in pack_of(req))
        target = "Nobody99" if player == invalid_from else picked or options[0]
        return {"tool": "GenerateStructuredOutput", "arguments": json.dumps({"target": target})}

    return script


def asked(fb: FakeBackend, key: str, player: str | None = None) -> list[dict[str, Any]]:
    """The requests (bodies) whose question contains ``key`` (of ``player`` if given)."""
    bodies = [r["body"] for r in fb.requests]
    return [b for b in bodies if key in prompt_of(b) and (player is None or player_of(b) == player)]


def seats(row: dict[str, Any]) -> dict[str, list[str]]:
    """The row's deal: each role's players."""
    out: dict[str, list[str]] = {}
    for p in rules.deal(row["seed"]).players:
        out.setdefault(p.role, []).append(p.name)
    return out


async def play(tmp_path: Path, rows: list[dict], script, **resources: vl.LLM):
    """``rows`` played through ``Trainer.dev`` against the scripted backend (the opponent's
    endpoint a second one): the result, the store and both backends."""
    store = InMemoryStore()
    async with FakeBackend() as fb, FakeBackend() as opponent:
        fb.script = opponent.script = script
        trainer = fake_trainer(store, tmp_path, vl.LLM(endpoint=fb.url, model="fake-model"))
        trainer.resources["opponent_llm"] = vl.LLM(endpoint=opponent.url, model="hosted-model")
        result = await trainer.dev_async(agent.werewolf_game, rows)
    return result, store, fb, opponent


async def game_event(store: InMemoryStore, rollout_id: str) -> dict[str, Any]:
    """The game's ``game`` event: winner, rules, rounds, counts, roles."""
    [event] = [s for s in await store.get_spans(rollout_id) if s.name == "game"]
    return event.attributes
