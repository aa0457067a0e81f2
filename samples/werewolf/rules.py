"""Werewolf's rules, framework-free: who plays what, who is alive, who won, how votes count.

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

ROLES_9 = ("werewolf",) * 3 + ("villager",) * 3 + ("seer", "witch", "hunter")
SIDES = ("wolves", "village")


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


def tally(votes: dict[str, str | None]) -> str | None:
    """The name with the most votes (``None`` votes abstain); None on a tie or no vote."""
    counts = Counter(v for v in votes.values() if v is not None)
    if not counts:
        return None
    (top, n), *rest = counts.most_common()
    return None if rest and rest[0][1] == n else top
