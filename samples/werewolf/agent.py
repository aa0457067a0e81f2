"""Werewolf on AgentScope 2.x: nine players, each its own ``Agent``, some on the model being
trained and some on an external one; each team's calls credited with the team's outcome.

One rollout is one game (a row from :func:`game_rows`): the table is dealt from the row's
seed, then nights and days alternate until a side wins or ``max_rounds`` pass (a draw):

- night: the werewolves talk among themselves and vote a victim; the witch may save the
  victim and may poison someone (each potion once); the seer checks one player; the dead are
  taken out (a hunter shoots someone as he dies, unless poisoned);
- day: the deaths are announced, every player speaks in turn, all vote, the player with the
  most votes is eliminated (a tie eliminates no one) after last words.

Every choice is AgentScope structured output whose schema lists only the legal answers; an
answer that is still not legal after a retry counts as invalid: the player's seat gets a
penalty reward right after that call (``INVALID_PENALTY``) and a random legal answer is
played. A prompt over the model's context (the gateway's ``context_length_exceeded``) is
handled the same way; each player's memory is kept under ``HISTORY_BUDGET_CHARS`` by
dropping the oldest messages.

Each model call is recorded under ``<model>/<side>/<role>/<player>`` (``policy`` or
``external``), so ``side_filter`` selects one side's, or both sides', trained calls; at the
end each side's outcome is emitted as the final reward of its calls
(``emit_reward(v, agents="[^/]+/<side>/.*")``).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any, Literal

from agentscope.agent import Agent, InjectionConfig, ReActConfig
from agentscope.formatter import OpenAIMultiAgentFormatter
from agentscope.message import AssistantMsg, UserMsg
from agentscope.middleware import TracingMiddleware
from pydantic import create_model
from rules import SIDES, GameState, Player, deal, tally

import voltrl as vl
from voltrl.adapters.agentscope import chat_model, instrument
from voltrl.gateway import is_context_overflow

# AgentScope logs every model call that fails at WARNING (a refused prompt included); the game
# counts those itself and reports them in its ``game`` event.
logging.getLogger("as").setLevel(logging.ERROR)

MAX_ROUNDS = 4
INVALID_PENALTY = -0.2
HISTORY_BUDGET_CHARS = 6_000
#: What each side's calls get for the game's outcome (a draw: both ``draw``).
OUTCOME = {"win": 1.0, "loss": 0.0, "draw": 0.0}
RULES = (
    "You play Werewolf with 9 players: 3 werewolves, 3 villagers, a seer, a witch and a "
    "hunter. At night the werewolves kill one player; the seer learns whether one player is a "
    "werewolf; the witch can save the victim once and poison one player once; a hunter who "
    "dies shoots one player, unless poisoned. By day everyone speaks, then votes to eliminate "
    "one player. The village wins when no werewolf is left; the werewolves win when they are "
    "at least as many as the others. Speak in one or two short sentences."
)


def side_filter(train: str) -> str:
    """The trajectory builder's agent filter for the trained side: ``wolves``, ``village``
    or ``both`` (external players' calls never match)."""
    sides = "|".join(SIDES) if train == "both" else train
    return rf"policy/({sides})/[^/]+/[^/]+"


def game_rows(
    n: int, seed: int = 0, *, train: str = "village", external: dict | None = None, **extra: Any
) -> list[dict[str, Any]]:
    """``n`` games (dataset rows): the deal's seed, the trained side (for the reward the
    rollout returns), who plays on the external model (``{"side": "wolves"}``,
    ``{"role": "seer"}`` or ``{"fraction": 0.2}``; None: nobody), and ``extra`` settings:
    ``max_rounds``, ``outcome`` (per side, the rewards of a win, loss or draw, over
    :data:`OUTCOME`, e.g. ``{"wolves": {"win": 2.0}}``)."""
    return [
        {"seed": seed * 100_000 + i, "train": train, "external": external, **extra}
        for i in range(n)
    ]


def external_seats(state: GameState, external: dict | None, rng: random.Random) -> set[str]:
    """The players the external model plays."""
    if not external:
        return set()
    if "side" in external:
        return {p.name for p in state.players if p.side == external["side"]}
    if "role" in external:
        return {p.name for p in state.players if p.role == external["role"]}
    k = round(float(external["fraction"]) * len(state.players))
    return set(rng.sample([p.name for p in state.players], k))


def agent_name(player: Player, external: bool) -> str:
    """The name a player's calls are recorded under."""
    return f"{'external' if external else 'policy'}/{player.side}/{player.role}/{player.name}"


def role_prompt(player: Player, state: GameState) -> str:
    """A player's system prompt: the rules, who they are, what a werewolf knows."""
    text = f"{RULES}\nYou are {player.name}; your role is {player.role}."
    if player.role == "werewolf":
        mates = [p.name for p in state.alive("wolves") if p.name != player.name]
        text += f" The other werewolves are {', '.join(mates)}."
    return text


@dataclass
class Table:
    """A game being played: the state, each player's agent, and what went wrong."""

    state: GameState
    agents: dict[str, Agent]
    rng: random.Random
    invalid: int = 0
    overflows: int = 0
    decisions: int = 0
    events: list[str] = field(default_factory=list)

    async def tell(self, names: list[str], text: str) -> None:
        """The moderator says ``text`` to ``names`` (into their memory, no model call)."""
        for name in names:
            await self.agents[name].observe(UserMsg("moderator", text))

    def trim(self, name: str, budget: int = HISTORY_BUDGET_CHARS) -> None:
        """Drop a player's oldest memories until the rest fit ``budget`` characters
        (AgentScope keeps an agent's memory in ``agent.state.context``)."""
        context = self.agents[name].state.context
        while len(context) > 1 and sum(len(m.get_text_content() or "") for m in context) > budget:
            del context[0]


async def say(table: Table, name: str, prompt: str, audience: list[str]) -> str:
    """``name`` speaks; ``audience`` hears it."""
    table.trim(name)
    try:
        msg = await table.agents[name].reply(UserMsg("moderator", prompt))
        text = (msg.get_text_content() or "").strip() or "(says nothing)"
    except Exception as e:
        if not is_context_overflow(e):
            raise
        table.overflows += 1
        text = "(says nothing)"
    for other in audience:
        if other != name:
            await table.agents[other].observe(AssistantMsg(name, text))
    return text


async def decide(table: Table, name: str, prompt: str, choices: list[str], retries: int = 1) -> str:
    """``name`` picks one of ``choices`` as structured output (the schema allows only them).
    Each invalid answer costs ``INVALID_PENALTY`` on the call that gave it; a prompt the
    backend refused for its length (no call was made: no penalty) is retried on half the
    memory. After ``retries`` more tries a random legal choice is played."""
    schema = create_model(
        "Choice",
        target=(Literal[tuple(choices)], ...),  # type: ignore[valid-type]
        reason=(str, ""),
    )
    hint, budget = "", HISTORY_BUDGET_CHARS
    table.decisions += 1
    for _ in range(retries + 1):
        table.trim(name, budget)
        try:
            msg = await table.agents[name].reply(
                UserMsg("moderator", f"{prompt}{hint} Choose one of: {', '.join(choices)}."),
                structured_schema=schema,
            )
            target = (msg.structured_output or {}).get("target")
        except Exception as e:
            if is_context_overflow(e):
                table.overflows += 1
                budget //= 2
                continue
            if not isinstance(e, ValueError):  # AgentScope gives up on bad output so
                raise
            target = None
        if target in choices:
            return target
        vl.emit_reward(INVALID_PENALTY, name="invalid_output")  # on the call just made
        table.invalid += 1
        hint = " Your last answer was not one of the choices."
    return table.rng.choice(choices)


def _agents(state: GameState, resources: vl.Resources, external: set[str]) -> dict[str, Agent]:
    agents = {}
    for p in state.players:
        llm = resources["opponent_llm" if p.name in external else "main_llm"]
        model = chat_model(
            llm, agent_name(p, p.name in external), formatter=OpenAIMultiAgentFormatter()
        )
        agents[p.name] = Agent(
            name=p.name,
            system_prompt=role_prompt(p, state),
            model=model,
            middlewares=[TracingMiddleware()],
            injection_config=InjectionConfig(inject_runtime_state=False),
            react_config=ReActConfig(max_iters=2),
        )
    return agents


async def night(table: Table) -> list[str]:
    """One night; returns who died."""
    state, n = table.state, table.state.round
    wolves = state.names(state.alive("wolves"))
    prey = state.names(state.alive("village"))
    for wolf in wolves:
        await say(table, wolf, f"Night {n}. Werewolves, whom should you kill?", wolves)
    votes = {w: await decide(table, w, f"Night {n}: vote whom to kill.", prey) for w in wolves}
    victim = tally(votes) or table.rng.choice(sorted(set(votes.values())))
    saved = poisoned = None
    for witch in state.names(state.alive(role="witch")):
        if state.save_potion:
            choice = await decide(
                table, witch, f"Night {n}: the werewolves attack {victim}.", ["save", "pass"]
            )
            if choice == "save":
                saved, state.save_potion = victim, False
        if state.poison_potion:
            targets = ["nobody", *(x for x in state.names() if x != witch)]
            choice = await decide(table, witch, f"Night {n}: poison someone?", targets)
            if choice != "nobody":
                poisoned, state.poison_potion = choice, False
    for seer in state.names(state.alive(role="seer")):
        others = [x for x in state.names() if x != seer]
        checked = await decide(table, seer, f"Night {n}: whom do you check?", others)
        verdict = "a werewolf" if state.player(checked).side == "wolves" else "not a werewolf"
        await table.tell([seer], f"{checked} is {verdict}.")
    dead = [x for x in (None if victim == saved else victim, poisoned) if x]
    for name in dict.fromkeys(dead):
        state.kill(name)
    for name in list(dict.fromkeys(dead)):
        if state.player(name).role == "hunter" and name != poisoned:
            dead += await hunter_shoots(table, name)
    return list(dict.fromkeys(dead))


async def hunter_shoots(table: Table, hunter: str) -> list[str]:
    """The dying hunter may take someone with him."""
    targets = ["nobody", *table.state.names()]
    shot = await decide(table, hunter, "You are dying: shoot someone?", targets)
    if shot == "nobody":
        return []
    table.state.kill(shot)
    return [shot]


async def day(table: Table, dead: list[str]) -> None:
    """One day: the news, the talk, the vote, the last words."""
    state, n = table.state, table.state.round
    news = f"Day {n}. " + (f"Died last night: {', '.join(dead)}." if dead else "Nobody died.")
    await table.tell(state.names(), news)
    if state.winner():
        return
    alive = state.names()
    for name in alive:
        await say(table, name, f"Day {n}: your turn to speak.", alive)
    votes = {
        name: await decide(
            table, name, f"Day {n}: vote to eliminate.", [x for x in alive if x != name]
        )
        for name in alive
    }
    out = tally(votes)
    if out is None:
        await table.tell(state.names(), f"Day {n}: the vote is tied; nobody is eliminated.")
        return
    state.kill(out)
    await table.tell(state.names(), f"Day {n}: {out} is eliminated.")
    await say(table, out, "You are eliminated: your last words.", [*state.names(), out])
    if state.player(out).role == "hunter":
        shot = await hunter_shoots(table, out)
        await table.tell(state.names(), f"The hunter shot {', '.join(shot) or 'nobody'}.")


async def play(table: Table, max_rounds: int) -> str | None:
    """Nights and days until a side wins (its name) or ``max_rounds`` pass (None)."""
    while table.state.round < max_rounds:
        table.state.round += 1
        dead = await night(table)
        if winner := table.state.winner():
            return winner
        await day(table, dead)
        if winner := table.state.winner():
            return winner
    return None


@vl.rollout
async def werewolf_game(row: dict, resources: vl.Resources) -> float:
    """One game; the reward is the trained side's outcome (``row["train"]``; ``both``: the
    village's). Each side's outcome is also the final reward of its players' calls."""
    instrument()
    rng = random.Random(row["seed"])
    state = deal(row["seed"])
    external = external_seats(state, row.get("external"), rng)
    table = Table(state, _agents(state, resources, external), rng)
    winner = await play(table, int(row.get("max_rounds", MAX_ROUNDS)))
    outcome = {}
    for side in SIDES:
        values = {**OUTCOME, **(row.get("outcome") or {}).get(side, {})}
        outcome[side] = values["draw" if winner is None else "win" if winner == side else "loss"]
        vl.emit_reward(outcome[side], name=f"outcome/{side}", agents=rf"[^/]+/{side}/.*")
    vl.emit_event(
        "game",
        winner=winner or "draw",
        rounds=state.round,
        decisions=table.decisions,
        invalid_outputs=table.invalid,
        context_overflows=table.overflows,
        external_seats=sorted(external),
        roles={p.name: p.role for p in state.players},
    )
    return outcome["village" if row.get("train", "village") == "both" else row["train"]]
