"""samples/werewolf/teacher.py: the scripted teacher plays whole games, every seat, through the
real AgentScope agents and VoltRL's teacher server over loopback HTTP; every recorded choice
is a legal structured answer, the werewolves agree and never bite one of their own, the seer
never checks a player twice and reveals the werewolves she finds, the witch saves on the
first night, the village votes a revealed werewolf, and a re-run records the same games. The
parsing is checked on the requests those games recorded and on prompts built with the game's
own system prompt, pinned note and AgentScope's multi-agent formatter."""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
from agentscope.formatter import OpenAIMultiAgentFormatter
from agentscope.message import AssistantMsg, UserMsg
from helpers import SAMPLES, fake_trainer, load_sample
from pydantic import create_model
from werewolf_script import agent, rules

import voltrl as vl
from voltrl.serving.teacher import serve_teacher
from voltrl.store.memory import InMemoryStore

teacher = load_sample("werewolf", "teacher")
memory = load_sample("werewolf", "memory")

ROWS = [
    *agent.game_rows(3, seed=11),
    *agent.game_rows(1, seed=12, rules="short"),
    agent.game_rows(1, seed=11)[0],  # the first game again: the same game is recorded
]
SPEECH_PROMPTS = ("werewolves' talk", "your turn to speak", "your last words")
CHOICE_PROMPTS = (
    "do the werewolves agree on a victim?",
    "vote whom to kill.",
    "Use your healing potion?",
    "poison someone?",
    "whom do you check?",
    "You are dying: shoot someone?",
    "vote to eliminate.",
)


@dataclass
class Call:
    """One recorded call: what the player saw (parsed) and what the teacher answered."""

    view: Any
    request: dict[str, Any]
    answer: str
    """The speech, or the structured output's ``target``."""


@dataclass
class Game:
    """A game the teacher played: its row, its ``game`` event and its calls in order."""

    row: dict[str, Any]
    event: dict[str, Any]
    status: str
    calls: list[Call]

    def role(self, name: str) -> str:
        return self.event["roles"][name]

    def asked(self, key: str, role: str | None = None) -> list[Call]:
        """The choices whose question contains ``key`` (of players of ``role``)."""
        return [
            c
            for c in self.calls
            if c.view.choices is not None
            and key in c.view.prompt
            and (role is None or c.view.role == role)
        ]


def answer_of(response: dict[str, Any]) -> str:
    """The speech, or the ``target`` of the one structured-output call, of a response."""
    message = response["choices"][0]["message"]
    if not message.get("tool_calls"):
        return message["content"]
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "GenerateStructuredOutput"
    return json.loads(call["function"]["arguments"])["target"]


async def play_all(run_dir: Path) -> list[Game]:
    store = InMemoryStore()
    with serve_teacher(teacher.policy, seed=0) as url:
        llm = vl.LLM(endpoint=url, model="teacher")
        trainer = fake_trainer(store, run_dir, llm, request_token_ids=False)
        result = await trainer.dev_async(agent.werewolf_game, ROWS)
    games = []
    for rollout in sorted(result.rollouts, key=lambda r: r.task.index or 0):
        spans = await store.get_spans(rollout.rollout_id)
        event = next((s.attributes for s in spans if s.name == "game"), {})
        records = sorted(await store.get_llm_calls(rollout.rollout_id), key=lambda c: c.started_at)
        calls = [
            Call(
                teacher.read_view(c.request["messages"], c.request.get("tools") or []),
                c.request,
                answer_of(c.response),
            )
            for c in records
        ]
        games.append(Game(rollout.task.input, event, rollout.status, calls))
    return games


@pytest.fixture(scope="module")
def games(tmp_path_factory: pytest.TempPathFactory) -> list[Game]:
    """The games of :data:`ROWS`, played once for the module's tests."""
    return asyncio.run(play_all(tmp_path_factory.mktemp("teacher")))


@pytest.mark.timeout(300)
def test_every_choice_is_a_legal_structured_answer(games: list[Game]) -> None:
    assert [g.row["seed"] for g in games] == [r["seed"] for r in ROWS]
    for game in games:
        assert game.status == "succeeded"
        assert game.event["winner"] in ("wolves", "village", "draw")
        assert game.event["invalid_outputs"] == 0 and game.event["fallbacks"] == 0
        assert game.event["legal_choices"] == 1.0
        assert game.event["context_overflows"] == 0
        choices = [c for c in game.calls if c.view.choices is not None]
        assert len(choices) == game.event["decisions"] > 0
        for call in game.calls:
            if call.view.choices is None:
                assert any(k in call.view.prompt for k in SPEECH_PROMPTS), call.view.prompt
                assert 0 < len(call.answer) < 200 and "\n" not in call.answer
            else:
                assert any(
                    call.view.prompt.startswith(p) or p in call.view.prompt for p in CHOICE_PROMPTS
                ), call.view.prompt
                assert call.answer in call.view.choices
    assert {g.event["rules"] for g in games} == {"agentscope", "short"}


def test_the_werewolves_agree_on_one_victim_and_never_bite_a_wolf(games: list[Game]) -> None:
    nights = 0
    for game in games:
        ballots: dict[str, set[str]] = {}
        for call in game.asked("vote whom to kill"):
            assert game.role(call.answer) != "werewolf", call.view.prompt
            ballots.setdefault(call.view.prompt.split(":")[0], set()).add(call.answer)
        assert all(len(names) == 1 for names in ballots.values()), ballots
        nights += len(ballots)
        for call in game.asked("do the werewolves agree"):
            assert call.answer == "agree"
        for call in game.calls:  # their talk names the victim they then vote
            if "werewolves' talk" in call.view.prompt:
                named = re.fullmatch(r"Let us kill (\w+)\.", call.answer)
                assert named and game.role(named.group(1)) != "werewolf"
    assert nights >= len(games)


def test_the_seer_checks_nobody_twice_and_reveals_the_werewolves_she_finds(
    games: list[Game],
) -> None:
    revealed = 0
    for game in games:
        checked: list[str] = []
        for call in game.asked("whom do you check", role="seer"):
            fresh = [c for c in call.view.choices if c not in checked]
            assert call.answer not in checked or not fresh
            checked.append(call.answer)
        for call in game.calls:
            if call.view.role != "seer" or call.view.choices is not None:
                continue
            checks = teacher.my_checks(call.view)
            assert checks == {p: game.role(p) == "werewolf" for p in checks}  # her note, parsed
            alive = teacher.alive(call.view)
            found = [p for p, wolf in checks.items() if wolf and p in alive]
            if found and "your turn to speak" in call.view.prompt:
                assert call.answer.startswith("I am the seer.") and (
                    f"{found[0]} is a werewolf." in call.answer
                )
                revealed += 1
    assert revealed >= 1


def test_the_witch_saves_on_the_first_night_and_poisons_only_a_werewolf(
    games: list[Game],
) -> None:
    first_nights = 0
    for game in games:
        for call in game.asked("healing potion", role="witch"):
            assert call.answer == "save"
            first_nights += call.view.prompt.startswith("Night 1:")
        for call in game.asked("poison someone", role="witch"):
            assert call.answer == "nobody" or game.role(call.answer) == "werewolf"
    assert first_nights >= 3


def test_the_village_votes_a_revealed_werewolf_and_the_hunter_shoots_a_named_one(
    games: list[Game],
) -> None:
    votes = 0
    for game in games:
        for call in game.asked("vote to eliminate"):
            if call.view.wolf:
                assert game.role(call.answer) != "werewolf"
                continue
            facts = teacher.known(call.view)
            wolves = [c for c in call.view.choices if facts.get(c)]
            if wolves:
                assert call.answer == wolves[0]
                votes += 1
        for call in game.asked("shoot someone", role="hunter"):
            assert call.answer in call.view.choices
    assert votes >= 1


def test_a_rerun_records_the_same_game(games: list[Game]) -> None:
    first, again = games[0], games[-1]
    assert first.row["seed"] == again.row["seed"]
    assert [c.answer for c in first.calls] == [c.answer for c in again.calls]
    assert [c.request for c in first.calls] == [c.request for c in again.calls]


def test_the_views_of_the_recorded_requests_match_the_deal(games: list[Game]) -> None:
    for game in games:
        state = rules.deal(game.row["seed"])
        wolves = {p.name for p in state.players if p.role == "werewolf"}
        for call in game.calls:
            view = call.view
            assert view.role == game.role(view.me)
            assert view.players == [p.name for p in state.players]
            assert set(view.pack) == (wolves - {view.me} if view.wolf else set())
            if call.view.choices is not None:
                tool = call.request["tools"][0]["function"]
                assert view.choices == tool["parameters"]["properties"]["target"]["enum"]
                assert f"Choose one of: {', '.join(view.choices)}." in view.prompt
            assert teacher.dead(view) <= set(view.players)


# --- the parsing and the play on prompts built as the game builds them -------------------

STATE = rules.deal(0)
RULES = rules.RULESETS["agentscope"]
ROLES = {
    "Player1": "witch",
    "Player2": "villager",
    "Player3": "werewolf",
    "Player4": "villager",
    "Player5": "villager",
    "Player6": "werewolf",
    "Player7": "werewolf",
    "Player8": "hunter",
    "Player9": "seer",
}


def request(
    name: str,
    history: list[tuple[str, str]],
    note: tuple[str, ...] = (),
    choices: list[str] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The messages and tools of ``name``'s call as the game makes them (deal 0): the role
    prompt and pinned note, the history (``moderator`` lines are the moderator's) rendered by
    AgentScope's multi-agent formatter; a choice's question ends with its choices, and its
    schema (:func:`game.decide`'s) is the structured-output tool."""
    system = agent.role_prompt(STATE.player(name), STATE, RULES)
    system = asyncio.run(memory.PinnedNote(lambda: list(note)).on_system_prompt(None, system))
    msgs = [UserMsg("moderator", t) if s == "moderator" else AssistantMsg(s, t) for s, t in history]
    tools = []
    if choices is not None:
        msgs[-1] = UserMsg("moderator", f"{history[-1][1]} Choose one of: {', '.join(choices)}.")
        schema = create_model(
            "Choice",
            target=(Literal[tuple(choices)], ...),  # type: ignore[valid-type]
            reason=(str, ""),
        )
        parameters = schema.model_json_schema()
        tools = [
            {
                "type": "function",
                "function": {"name": "GenerateStructuredOutput", "parameters": parameters},
            }
        ]
    formatted = asyncio.run(OpenAIMultiAgentFormatter().format(msgs))
    return [{"role": "system", "content": system}, *formatted], tools


def answer(name: str, history: list[tuple[str, str]], **kwargs: Any) -> str:
    """The teacher's reply to ``name``'s request: the speech, or the chosen target."""
    reply = teacher.policy(*request(name, history, **kwargs), rng=random.Random(0))
    return reply if isinstance(reply, str) else reply["arguments"]["target"]


def others(name: str) -> list[str]:
    """Everyone but ``name``, in seat order."""
    return [p for p in ROLES if p != name]


def test_a_view_reads_the_role_the_pack_the_note_the_history_and_the_choices() -> None:
    assert {p.name: p.role for p in STATE.players} == ROLES
    note = ("Night 1: you voted Player5.", "Night 1: the werewolves attacked Player5.")
    history = [
        ("moderator", "Day 1. Died last night: Player5."),
        ("Player2", "I suspect Player4.\nReally."),
        ("moderator", "Day 1: vote to eliminate."),
    ]
    messages, tools = request("Player3", history, note=note, choices=others("Player3"))
    view = teacher.read_view(messages, tools)
    assert (view.me, view.role, view.wolf, view.pack) == (
        "Player3",
        "werewolf",
        True,
        ["Player6", "Player7"],
    )
    assert view.note == list(note) and view.choices == others("Player3")
    assert view.players == list(ROLES) and view.tool == "GenerateStructuredOutput"
    assert view.lines[1] == ("Player2", "I suspect Player4. Really.")
    assert (
        view.prompt == f"Day 1: vote to eliminate. Choose one of: {', '.join(others('Player3'))}."
    )
    assert view.when == ("Day", 1)
    assert teacher.dead(view) == {"Player5"} and "Player5" not in teacher.alive(view)
    assert teacher.accused(view) == {"Player4": 1}
    speech = teacher.read_view(*request("Player2", history[:2]))
    assert speech.choices is None and speech.pack == [] and speech.note == []


def test_the_werewolves_follow_the_first_proposal_heard_and_agree_when_they_do() -> None:
    talk = "Night 2, werewolves' talk (round 1 of at most 3): whom to kill?"
    history = [
        ("moderator", "Day 1: The votes: Player2 -> Player4 (tally: Player4 1)."),
        ("Player3", "Let us kill Player5."),
        ("moderator", talk),
    ]
    assert answer("Player6", history) == "Let us kill Player5."
    vote = [
        *history,
        ("Player6", "Let us kill Player5."),
        ("moderator", "Night 2: vote whom to kill."),
    ]
    assert answer("Player6", vote, choices=list(ROLES)) == "Player5"
    question = ("moderator", "Night 2: do the werewolves agree on a victim?")
    split = [
        ("moderator", talk),
        ("Player3", "Let us kill Player5."),
        ("Player6", "Let us kill Player1."),
        ("Player7", "Let us kill Player5."),
        question,
    ]
    assert answer("Player7", split, choices=["agree", "talk on"]) == "talk on"
    split[2] = ("Player6", "Let us kill Player5.")
    assert answer("Player7", split, choices=["agree", "talk on"]) == "agree"
    # the first to speak: a claimed seer, else one of the village, never a werewolf
    claim = [
        ("moderator", "Day 1. Nobody died."),
        ("Player9", "I am the seer. Player2 is a villager."),
        ("moderator", talk),
    ]
    assert answer("Player3", claim) == "Let us kill Player9."
    first = answer("Player3", [("moderator", talk)])
    assert first.startswith("Let us kill ") and ROLES[first[12:-1]] != "werewolf"


def test_the_seer_reveals_what_she_found_and_checks_someone_new() -> None:
    note = (
        "Night 1: you checked Player2: a villager.",
        "Night 2: you checked Player6: a werewolf.",
    )
    day = [("moderator", "Day 2. Nobody died."), ("moderator", "Day 2: your turn to speak.")]
    assert answer("Player9", day, note=note) == (
        "I am the seer. Player2 is a villager. Player6 is a werewolf. I suspect Player6."
    )
    checked = tuple(f"Night {i}: you checked Player{i}: a villager." for i in range(1, 7))
    night7 = [("moderator", "Night 7: whom do you check?")]
    ask = request("Player9", night7, note=checked, choices=others("Player9"))
    picks = {teacher.policy(*ask, rng=random.Random(s))["arguments"]["target"] for s in range(20)}
    assert picks == {"Player7", "Player8"}  # the two not checked, drawn by the rng
    # everyone offered checked already: still a legal answer
    ask = request("Player9", night7, note=checked, choices=["Player2", "Player3"])
    assert teacher.policy(*ask, rng=random.Random(0))["arguments"]["target"] in (
        "Player2",
        "Player3",
    )
    # no werewolf found and nobody accuses her: she keeps quiet
    quiet = answer("Player9", day, note=note[:1])
    assert quiet.startswith("I suspect ") and "seer" not in quiet


def test_the_village_the_witch_and_the_hunter_act_on_a_revealed_werewolf() -> None:
    reveal = "I am the seer. Player2 is a villager. Player6 is a werewolf. I suspect Player6."
    heard = [
        ("moderator", "Day 2. Nobody died."),
        ("Player9", reveal),
        ("Player6", "I suspect Player9."),
    ]
    vote = [*heard, ("moderator", "Day 2: vote to eliminate.")]
    for villager in ("Player1", "Player4", "Player5", "Player8"):
        assert answer(villager, vote, choices=others(villager)) == "Player6"
    assert answer("Player4", [*heard, ("moderator", "Day 2: your turn to speak.")]) == (
        "I suspect Player6."
    )
    shoot = [*heard, ("moderator", "You are dying: shoot someone?")]
    assert answer("Player8", shoot, choices=["nobody", *others("Player8")]) == "Player6"
    poison = [*heard, ("moderator", "Night 3: poison someone?")]
    assert answer("Player1", poison, choices=["nobody", *others("Player1")]) == "Player6"
    assert answer("Player1", poison[:1] + poison[-1:], choices=["nobody", *others("Player1")]) == (
        "nobody"
    )
    assert answer("Player8", shoot[:1] + shoot[-1:], choices=["nobody", *others("Player8")]) == (
        "nobody"
    )
    heal = [("moderator", "Night 1: the werewolves attack Player4. Use your healing potion?")]
    assert answer("Player1", heal, choices=["save", "pass"]) == "save"
    # a werewolf never names one of the pack, nor the claimed seer by day
    for wolf in ("Player3", "Player7"):
        assert answer(wolf, vote, choices=others(wolf)) not in (
            "Player3",
            "Player6",
            "Player7",
            "Player9",
        )


def test_the_village_follows_the_most_accused_and_suspects_who_names_a_cleared_player() -> None:
    day = [
        ("moderator", "Day 1. Nobody died."),
        ("Player1", "I suspect Player4."),
        ("Player2", "I suspect Player3."),
        ("Player6", "I suspect Player3."),
        ("moderator", "Day 1: your turn to speak."),
    ]
    assert answer("Player5", day) == "I suspect Player3."
    tie = day[:3] + day[-1:]  # one each: the first accused
    assert answer("Player5", tie) == "I suspect Player4."
    cleared = [
        ("moderator", "Day 2. Nobody died."),
        ("Player9", "I am the seer. Player2 is a villager. I suspect Player5."),
        ("Player7", "I suspect Player2."),
        ("moderator", "Day 2: vote to eliminate."),
    ]
    assert answer("Player4", cleared, choices=others("Player4")) == "Player7"


@pytest.mark.timeout(300)
def test_run_py_dev_teacher_seats_every_player_on_the_teacher(tmp_path: Path) -> None:
    """``run.py dev --teacher``: two short games, every answer legal, the report says so."""
    run = [sys.executable, str(SAMPLES / "werewolf" / "run.py"), "dev"]
    out = subprocess.run(
        [*run, "--teacher", "--games", "2", "--max-rounds", "3", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dev: 2 game(s)" in out.stdout and "legal answers 100% (" in out.stdout, out.stdout
    assert "(0.0 played at random)" in out.stdout and "0.0 invalid answers" in out.stdout
    wrong = subprocess.run(
        [*run, "--teacher", "--endpoint", "http://127.0.0.1:1/v1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert wrong.returncode == 2 and "--teacher plays instead of --endpoint" in wrong.stderr
