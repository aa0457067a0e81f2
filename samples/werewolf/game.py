"""The game on AgentScope 2.x agents: the moderator's nights and days under a rule set.

- night: the werewolves talk (up to ``wolf_discussion_rounds``, ending when they agree) and
  vote a victim; they see each other's votes and the victim (a tie: lots drawn among the
  tied, and they are told); the witch may save the victim and poison someone (each potion
  once; self-heal and both on one night as the rules say); the seer checks one player (its
  role, or whether it is a werewolf); the dead are taken out (a hunter shoots someone as he
  dies, unless poisoned);
- day: the deaths are announced (the first night's victim gives last words, if the rules
  say so), every player speaks in turn, all vote, every ballot and the tally are read out,
  the most voted is eliminated (a tie: lots, or nobody) after last words.

Every choice is structured output whose schema lists only the legal answers (:func:`decide`);
what each player must remember is written to its pinned note (:mod:`memory`). What is public
(the speeches by day, every vote with who was alive) and each player's answers are kept on
the :class:`Table` for the game's record (``log``, ``answers``), which the report reads.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from agentscope.agent import Agent
from agentscope.message import AssistantMsg, UserMsg
from memory import History
from pydantic import create_model
from rules import GameState, Rules, count_votes, outcome

import voltrl as vl
from voltrl.gateway import is_context_overflow

INVALID_PENALTY = -0.2
"""The reward put on a call whose answer was not one of the legal choices (a game's rows
may set their own: ``agent.game_rows(invalid_penalty=...)``)."""
CHOICE_REWARD = 0.0
"""The reward put on a call that votes out, bites, poisons or shoots a player of the other
side (0: none; a game's rows may set one: ``agent.game_rows(choice_reward=...)``): a signal
per decision, beside the game's outcome, which many decisions share."""


@dataclass
class Table:
    """A game being played: the state, the rules, each player's agent and pinned note, what
    went wrong, and the record the report reads (``answers``, ``log``)."""

    state: GameState
    rules: Rules
    agents: dict[str, Agent]
    rng: random.Random
    history: History
    invalid_penalty: float = INVALID_PENALTY
    """The reward put on each call whose answer was not a legal choice."""
    choice_reward: float = CHOICE_REWARD
    """The reward put on each call that names a player of the other side to remove."""
    notes: dict[str, list[str]] = field(default_factory=dict)
    invalid: int = 0
    overflows: int = 0
    decisions: int = 0
    fallbacks: int = 0
    lots_drawn: int = 0
    answers: dict[str, list[int]] = field(default_factory=dict)
    """Per player: ``[choices, invalid answers, choices played at random]``."""
    log: list[dict] = field(default_factory=list)
    """What happened, in order: ``{"kind": "speech", "when", "who", "text"}`` for each
    speech by day (last words included) and ``{"kind": "vote", "when", "ballots", "out",
    "alive"}`` for each vote, the werewolves' by night too (``out``: their victim; ``alive``:
    who was alive when they voted)."""

    async def tell(self, names: list[str], text: str) -> None:
        """The moderator says ``text`` to ``names`` (into their memory, no model call)."""
        for name in names:
            await self.agents[name].observe(UserMsg("moderator", text))

    def note(self, name: str, line: str) -> None:
        """Pin ``line`` to ``name``'s private note."""
        self.notes.setdefault(name, []).append(line)

    def note_of(self, name: str) -> list[str]:
        """``name``'s note as its prompts show it: the witch's potions left, then its lines."""
        lines = []
        if self.state.player(name).role == "witch":
            left = [p for p, kept in (("healing", self.state.save_potion),
                                      ("poison", self.state.poison_potion)) if kept]  # fmt: skip
            lines.append(f"Potions left: {', '.join(left) or 'none'}.")
        return lines + self.notes.get(name, [])

    def of_other_side(self, name: str, target: str) -> bool:
        """Whether ``target`` is a player (not ``nobody``) of the other side than ``name``."""
        sides = {p.name: p.side for p in self.state.players}
        return target in sides and sides[target] != sides[name]

    def trim(self, name: str, budget: int | None = None) -> None:
        """Keep ``name``'s memory under its token budget (``budget``: a smaller one)."""
        self.history.trim(self.agents[name].state.context, budget)


async def say(
    table: Table, name: str, prompt: str, audience: list[str], public: str | None = None
) -> str:
    """``name`` speaks; ``audience`` hears it. ``public`` (``"Day N"``): a speech by day,
    kept in the game's log."""
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
    if public:
        table.log.append({"kind": "speech", "when": public, "who": name, "text": text[:300]})
    return text


async def decide(
    table: Table,
    name: str,
    prompt: str,
    choices: list[str],
    retries: int = 1,
    *,
    removes: bool = False,
) -> str:
    """``name`` picks one of ``choices`` as structured output (the schema allows only them).
    ``removes``: the choice names a player to remove (a vote, a bite, a poison, a shot); a
    legal answer naming one of the other side earns ``table.choice_reward`` on its call.
    Each invalid answer costs ``table.invalid_penalty`` on the call that gave it; a prompt the
    backend refused for its length (no call was made: no penalty) is retried on half the
    memory. After ``retries`` more tries a random legal choice is played. A try that gave no
    legal answer leaves the player's memory (the question, the answer and AgentScope's own
    retries inside it, with their tool errors): the next try asks afresh, and no later call
    sees the failed one."""
    schema = create_model(
        "Choice",
        target=(Literal[tuple(choices)], ...),  # type: ignore[valid-type]
        reason=(str, ""),
    )
    hint, budget = "", table.history.budget
    table.decisions += 1
    counts = table.answers.setdefault(name, [0, 0, 0])  # choices, invalid, at random
    counts[0] += 1
    for _ in range(retries + 1):
        table.trim(name, budget)
        context = table.agents[name].state.context
        asked_at = len(context)
        try:
            msg = await table.agents[name].reply(
                UserMsg("moderator", f"{prompt}{hint} Choose one of: {', '.join(choices)}."),
                structured_schema=schema,
            )
            target = (msg.structured_output or {}).get("target")
        except Exception as e:
            if is_context_overflow(e):
                del context[asked_at:]
                table.overflows += 1
                budget //= 2
                continue
            if not isinstance(e, ValueError):  # AgentScope gives up on bad output so
                raise
            target = None
        if target in choices:
            if removes and table.choice_reward and table.of_other_side(name, target):
                vl.emit_reward(table.choice_reward, name="choice")  # on the call just made
            return target
        del context[asked_at:]
        vl.emit_reward(table.invalid_penalty, name="invalid_output")  # on the call just made
        table.invalid += 1
        counts[1] += 1
        hint = " Your last answer was not one of the choices."
    table.fallbacks += 1
    counts[2] += 1
    return table.rng.choice(choices)


async def vote(
    table: Table, when: str, question: str, choices: dict[str, list[str]], tie: str
) -> tuple[str | None, str]:
    """Each player ``choices`` names votes (none hears another's ballot before voting; each
    pins its own); returns who is out and the moderator's reading of the ballots and tally."""
    prompt = f"{when}: {question}"
    alive = table.state.names()
    ballots = {
        voter: await decide(table, voter, prompt, legal, removes=True)
        for voter, legal in choices.items()
    }
    for voter, name in ballots.items():
        table.note(voter, f"{when}: you voted {name}.")
    count = count_votes(ballots)
    out, drawn = outcome(count, tie, table.rng)
    table.lots_drawn += drawn
    table.log.append({"kind": "vote", "when": when, "ballots": ballots, "out": out, "alive": alive})
    text = f"The votes: {count.public()}."
    if len(count.top) > 1:
        tied = f"{', '.join(count.top[:-1])} and {count.top[-1]}"
        text += f" A tie between {tied}: " + (f"{out} is drawn by lot." if drawn else "nobody.")
    return out, text


async def night(table: Table) -> tuple[list[str], str | None]:
    """One night: the werewolves, the witch, the seer, then the deaths (and a dying hunter's
    shot); returns who died, and the werewolves' victim if the bite killed."""
    victim = await wolves_turn(table)
    saved, poisoned = await witch_turn(table, victim)
    await seer_turn(table)
    bitten = None if victim == saved else victim
    dead = list(dict.fromkeys(x for x in (bitten, poisoned) if x))
    for name in dead:
        table.state.kill(name)
    if bitten and table.state.player(bitten).role == "hunter" and bitten != poisoned:
        dead += await hunter_shoots(table, bitten)
    return dead, bitten


async def wolves_turn(table: Table) -> str:
    """The werewolves talk (up to the rules' rounds, until they agree), vote, and hear every
    ballot and the victim, whom they return."""
    state, rules, n = table.state, table.rules, table.state.round
    wolves = state.names(state.alive("wolves"))
    prey = state.names() if rules.wolves_may_target_wolves else state.names(state.alive("village"))
    rounds = rules.wolf_discussion_rounds if len(wolves) > 1 else 1
    for r in range(1, rounds + 1):
        for wolf in wolves:
            talk = f" (round {r} of at most {rounds})" if rounds > 1 else ""
            await say(table, wolf, f"Night {n}, werewolves' talk{talk}: whom to kill?", wolves)
        if r < rounds:
            question = f"Night {n}: do the werewolves agree on a victim?"
            if await decide(table, wolves[-1], question, ["agree", "talk on"]) == "agree":
                break
    choices = dict.fromkeys(wolves, prey)
    victim, text = await vote(table, f"Night {n}", "vote whom to kill.", choices, "draw_lots")
    assert victim is not None  # lots are drawn on a tie
    await table.tell(wolves, f"Night {n}, werewolves: {text} You attack {victim}.")
    for wolf in wolves:
        table.note(wolf, f"Night {n}: the werewolves attacked {victim}.")
    return victim


async def witch_turn(table: Table, victim: str) -> tuple[str | None, str | None]:
    """The witch may save ``victim`` and poison someone, as her potions and the rules allow;
    returns whom she saved and whom she poisoned."""
    state, rules, n = table.state, table.rules, table.state.round
    saved = poisoned = None
    for witch in state.names(state.alive(role="witch")):
        if state.save_potion and (rules.witch_self_heal or victim != witch):
            prompt = f"Night {n}: the werewolves attack {victim}. Use your healing potion?"
            if await decide(table, witch, prompt, ["save", "pass"]) == "save":
                saved, state.save_potion = victim, False
                table.note(witch, f"Night {n}: you saved {victim}.")
        if state.poison_potion and (rules.heal_and_poison_one_night or saved is None):
            targets = ["nobody", *(x for x in state.names() if x != witch)]
            choice = await decide(
                table, witch, f"Night {n}: poison someone?", targets, removes=True
            )
            if choice != "nobody":
                poisoned, state.poison_potion = choice, False
                table.note(witch, f"Night {n}: you poisoned {choice}.")
    return saved, poisoned


async def seer_turn(table: Table) -> None:
    """The seer checks one player: its role, or only whether it is a werewolf."""
    state, n = table.state, table.state.round
    for seer in state.names(state.alive(role="seer")):
        others = [x for x in state.names() if x != seer]
        checked = await decide(table, seer, f"Night {n}: whom do you check?", others)
        player = state.player(checked)
        if table.rules.seer_learns_role:
            verdict = f"{'an' if player.role[0] in 'aeiou' else 'a'} {player.role}"
        else:
            verdict = "a werewolf" if player.side == "wolves" else "not a werewolf"
        await table.tell([seer], f"{checked} is {verdict}.")
        table.note(seer, f"Night {n}: you checked {checked}: {verdict}.")


async def hunter_shoots(table: Table, hunter: str) -> list[str]:
    """The dying hunter may take someone with him."""
    targets = ["nobody", *table.state.names()]
    shot = await decide(table, hunter, "You are dying: shoot someone?", targets, removes=True)
    if shot == "nobody":
        return []
    table.state.kill(shot)
    return [shot]


async def day(table: Table, dead: list[str], bitten: str | None) -> None:
    """One day: the news (and the first night's last words), the talk, the public vote, the
    last words."""
    state, n = table.state, table.state.round
    news = f"Day {n}. " + (f"Died last night: {', '.join(dead)}." if dead else "Nobody died.")
    await table.tell(state.names(), news)
    when = f"Day {n}"
    if n == 1 and bitten and table.rules.first_night_last_words:
        last_words = "You died in the night: your last words."
        await say(table, bitten, last_words, state.names(), public=when)
    alive = state.names()
    for name in alive:
        await say(table, name, f"{when}: your turn to speak.", alive, public=when)
    choices = {name: [x for x in alive if x != name] for name in alive}
    out, text = await vote(table, f"Day {n}", "vote to eliminate.", choices, table.rules.day_tie)
    await table.tell(alive, f"Day {n}: {text}" + (f" {out} is eliminated." if out else ""))
    if out is None:
        return
    state.kill(out)
    await say(table, out, "You are eliminated: your last words.", alive, public=when)
    if state.player(out).role == "hunter":
        shot = await hunter_shoots(table, out)
        await table.tell(state.names(), f"The hunter shot {', '.join(shot) or 'nobody'}.")


async def play(table: Table) -> str | None:
    """Nights and days until a side wins (its name) or the rules' cap passes (None)."""
    while table.state.round < table.rules.max_rounds:
        table.state.round += 1
        dead, bitten = await night(table)
        if winner := table.state.winner():
            return winner
        await day(table, dead, bitten)
        if winner := table.state.winner():
            return winner
    return None
