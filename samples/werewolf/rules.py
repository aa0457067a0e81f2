"""Werewolf's rules, framework-free: who plays what, who is alive, who won, how votes count,
and the two rule sets (:data:`RULESETS`).

The classic 9-player game: 3 werewolves against 6 villagers, three of them with a power (the
seer checks one player a night; the witch has one potion to save the werewolves' victim and
one to poison a player; the hunter shoots someone when he dies, unless poisoned). Werewolves
win when they are at least as many as the others alive; the village wins when no werewolf is
left.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

ROLES_9 = ("werewolf",) * 3 + ("villager",) * 3 + ("seer", "witch", "hunter")
SIDES = ("wolves", "village")


@dataclass(frozen=True)
class Rules:
    """What the two rule sets of :data:`RULESETS` decide differently."""

    name: str
    max_rounds: int
    """Nights and days, then a draw (both sides' ``draw`` outcome)."""
    witch_self_heal: bool
    """Whether the witch may save herself (else she is not asked when she is the victim)."""
    heal_and_poison_one_night: bool
    """Whether the witch may poison on the night she used her healing potion."""
    seer_learns_role: bool
    """The seer learns the checked player's role, else only whether it is a werewolf."""
    first_night_last_words: bool
    """The werewolves' victim of the first night speaks before the first day's talk."""
    wolf_discussion_rounds: int
    """At most this many rounds of the werewolves' talk a night; after each but the last, the
    last wolf to speak says whether they agree (then they vote)."""
    day_tie: Literal["draw_lots", "nobody"]
    """A tied day vote: one of the tied is drawn by lot and eliminated, or nobody is. (The
    werewolves' night vote always draws lots among the tied.)"""
    wolves_may_target_wolves: bool
    """Whether the werewolves may vote to kill one of their own."""


RULESETS = {
    # AgentScope's own game (examples/game/werewolves): its utils.py caps 30 rounds and 3
    # discussion rounds; its majority vote always names someone.
    "agentscope": Rules(
        name="agentscope",
        max_rounds=30,
        witch_self_heal=False,
        heal_and_poison_one_night=False,
        seer_learns_role=True,
        first_night_last_words=True,
        wolf_discussion_rounds=3,
        day_tie="draw_lots",
        wolves_may_target_wolves=True,
    ),
    # a short game for tiny models and tests: 4 rounds, one round of the wolves' talk
    "short": Rules(
        name="short",
        max_rounds=4,
        witch_self_heal=True,
        heal_and_poison_one_night=True,
        seer_learns_role=False,
        first_night_last_words=False,
        wolf_discussion_rounds=1,
        day_tie="nobody",
        wolves_may_target_wolves=False,
    ),
}
"""The rule sets a game row names (``rules``): ``agentscope`` (the default) or ``short``."""


def ruleset(name: str | None) -> Rules:
    """The rule set called ``name`` (None: ``agentscope``); a ValueError names the others."""
    try:
        return RULESETS[name or "agentscope"]
    except KeyError:
        raise ValueError(f"no rule set {name!r} (known: {', '.join(RULESETS)})") from None


def side_of(role: str) -> str:
    """``wolves`` for a werewolf, else ``village``."""
    return "wolves" if role == "werewolf" else "village"


@dataclass
class Player:
    """One seat at the table."""

    name: str
    role: str
    alive: bool = True

    @property
    def side(self) -> str:
        """The player's team."""
        return side_of(self.role)


@dataclass
class GameState:
    """The table: players, the witch's potions, the round, the public record."""

    players: list[Player]
    round: int = 0
    save_potion: bool = True
    poison_potion: bool = True
    announcements: list[str] = field(default_factory=list)

    def alive(self, side: str | None = None, role: str | None = None) -> list[Player]:
        """Alive players, of one side or role if given, in seat order."""
        return [
            p
            for p in self.players
            if p.alive and (side is None or p.side == side) and (role is None or p.role == role)
        ]

    def player(self, name: str) -> Player:
        """The player called ``name``."""
        return next(p for p in self.players if p.name == name)

    def names(self, players: list[Player] | None = None) -> list[str]:
        """Names of ``players`` (default: the alive ones)."""
        return [p.name for p in (self.alive() if players is None else players)]

    def kill(self, name: str) -> None:
        """``name`` is dead."""
        self.player(name).alive = False

    def winner(self) -> str | None:
        """``village`` when no werewolf is alive, ``wolves`` when they are at least as many
        as the others, else None (the game goes on)."""
        wolves, others = len(self.alive("wolves")), len(self.alive("village"))
        if wolves == 0:
            return "village"
        if wolves >= others:
            return "wolves"
        return None


def deal(seed: int, names: list[str] | None = None) -> GameState:
    """A 9-player table with roles shuffled by ``seed`` (players ``Player1``..``Player9``)."""
    roles = list(ROLES_9)
    random.Random(seed).shuffle(roles)
    names = names or [f"Player{i + 1}" for i in range(len(roles))]
    return GameState([Player(n, r) for n, r in zip(names, roles, strict=True)])


@dataclass
class VoteCount:
    """A vote's ballots (voter → name), counted."""

    ballots: dict[str, str]
    tally: Counter[str]

    @property
    def top(self) -> list[str]:
        """The names with the most votes (several on a tie), in the order the ballots first
        name them."""
        most = max(self.tally.values(), default=0)
        return [name for name, n in self.tally.items() if n == most and most > 0]

    def public(self) -> str:
        """The ballots and the tally as the moderator reads them out."""
        ballots = ", ".join(f"{voter} -> {name}" for voter, name in self.ballots.items())
        tally = ", ".join(f"{name} {n}" for name, n in self.tally.most_common())
        return f"{ballots} (tally: {tally})"


def count_votes(ballots: dict[str, str]) -> VoteCount:
    """The ballots counted."""
    return VoteCount(dict(ballots), Counter(ballots.values()))


def outcome(count: VoteCount, tie: str, rng: random.Random) -> tuple[str | None, bool]:
    """Who a vote puts out, and whether lots were drawn: the most voted; on a tie one of the
    tied drawn with ``rng`` (``tie="draw_lots"``) or nobody (``"nobody"``)."""
    top = count.top
    if len(top) <= 1:
        return (top[0] if top else None), False
    if tie == "nobody":
        return None, False
    return rng.choice(top), True
