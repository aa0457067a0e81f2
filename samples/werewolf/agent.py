"""Werewolf on AgentScope 2.x: nine players, each its own ``Agent``, some on the model being
trained and some on an external one; each team's calls credited with the team's outcome.

One rollout is one game (a row from :func:`game_rows`): the table is dealt from the row's
seed, then :mod:`game` plays nights and days under the row's rule set (:data:`rules.RULESETS`:
``agentscope``, AgentScope's own game, or ``short``) until a side wins or the round cap
passes (a draw).

Each model call is recorded under ``<model>/<side>/<role>/<player>`` (``policy`` or
``external``), so ``side_filter`` selects one side's, or both sides', trained calls; at the
end each side's outcome is emitted as the final reward of its calls
(``emit_reward(v, agents="[^/]+/<side>/.*")``).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from math import inf
from typing import Any

from agentscope.agent import Agent, InjectionConfig, ReActConfig
from agentscope.formatter import OpenAIMultiAgentFormatter
from agentscope.middleware import TracingMiddleware
from game import CHOICE_REWARD, INVALID_PENALTY, Table, play
from memory import HISTORY_TOKENS, History, PinnedNote, token_counter
from rules import SIDES, GameState, Player, Rules, deal, ruleset

import voltrl as vl
from voltrl.adapters.agentscope import chat_model, instrument

__all__ = [
    "CHOICE_REWARD",
    "INVALID_PENALTY",
    "OUTCOME",
    "SIDE_GROUPS",
    "agent_name",
    "game_rows",
    "reward_errors",
    "rules_prompt",
    "side_filter",
    "werewolf_game",
]

# AgentScope logs every model call that fails at WARNING (a refused prompt included); the game
# counts those itself and reports them in its ``game`` event.
logging.getLogger("as").setLevel(logging.ERROR)

#: What each side's calls get for the game's outcome (a draw: both ``draw``).
OUTCOME = {"win": 1.0, "loss": 0.0, "draw": 0.0}
SIDE_GROUPS = r"[^/]+/([^/]+)/.*"
"""``TrajectoryConfig.group_by_agent`` for the recorded names: one GRPO group per side."""


def rules_prompt(rules: Rules) -> str:
    """The rules as every player's system prompt states them, a clause per rule."""
    bite = "one player (even one of their own)" if rules.wolves_may_target_wolves else "a villager"
    seer = (
        "the role of one player" if rules.seer_learns_role else "whether one player is a werewolf"
    )
    heal = "the victim" if rules.witch_self_heal else "the victim (not herself)"
    both = "" if rules.heal_and_poison_one_night else ", never both on one night"
    last = " The first night's victim gives last words." if rules.first_night_last_words else ""
    tie = "a tie is settled by lot" if rules.day_tie == "draw_lots" else "a tie eliminates nobody"
    return (
        "You play Werewolf with 9 players: 3 werewolves, 3 villagers, a seer, a witch and a "
        f"hunter. At night the werewolves kill {bite}; the seer learns {seer}; the witch can "
        f"save {heal} once and poison one player once{both}; a hunter who dies shoots one "
        f"player, unless poisoned.{last} By day everyone speaks, then all vote in public to "
        f"eliminate one player ({tie}), who gives last words. The village wins when no "
        "werewolf is left; the werewolves win when they are at least as many as the others; "
        f"after {rules.max_rounds} round{'s' * (rules.max_rounds != 1)} it is a draw. Speak in "
        "one or two short sentences."
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
    ``rules`` (a :data:`rules.RULESETS` name, default ``agentscope``), ``max_rounds`` (default:
    the rules'), ``history_tokens`` (each player's history budget, default
    :data:`memory.HISTORY_TOKENS`), ``tokenizer`` (the model whose tokenizer counts it, as
    LocalRL names models; default: about 4 characters a token), ``outcome`` (per side, the
    rewards of a win, loss or draw, over :data:`OUTCOME`, e.g. ``{"wolves": {"win": 2.0}}``),
    ``invalid_penalty`` (the reward of a call whose answer is not a legal choice, at most 0;
    default :data:`INVALID_PENALTY`), ``choice_reward`` (the reward of a call that votes out,
    bites, poisons or shoots a player of the other side, at least 0; default
    :data:`CHOICE_REWARD`: none)."""
    ruleset(extra.get("rules"))  # an unknown rule set or tokenizer fails here, not every game
    token_counter(extra.get("tokenizer"))
    for key in ("max_rounds", "history_tokens"):
        if extra.get(key) is not None and int(extra[key]) < 1:
            raise ValueError(f"{key} must be at least 1, not {extra[key]}")
    if wrong := reward_errors(extra.get("invalid_penalty"), extra.get("choice_reward")):
        raise ValueError("; ".join(wrong))
    return [
        {"seed": seed * 100_000 + i, "train": train, "external": external, **extra}
        for i in range(n)
    ]


def reward_errors(invalid_penalty: float | None, choice_reward: float | None) -> list[str]:
    """What is wrong with a game's reward settings (None: the default), a line each
    (``invalid_penalty must be finite and at most 0, not 0.5``); none when both are right."""
    wrong = []
    if invalid_penalty is not None and not -inf < float(invalid_penalty) <= 0:
        wrong.append(f"invalid_penalty must be finite and at most 0, not {invalid_penalty}")
    if choice_reward is not None and not 0 <= float(choice_reward) < inf:
        wrong.append(f"choice_reward must be finite and at least 0, not {choice_reward}")
    return wrong


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


def role_prompt(player: Player, state: GameState, rules: Rules) -> str:
    """A player's system prompt: the rules, who they are, what a werewolf knows."""
    text = f"{rules_prompt(rules)}\nYou are {player.name}; your role is {player.role}."
    if player.role == "werewolf":
        mates = [p.name for p in state.alive("wolves") if p.name != player.name]
        text += f" The other werewolves are {', '.join(mates)}."
    return text


def _agents(table: Table, resources: vl.Resources, external: set[str]) -> dict[str, Agent]:
    agents, state = {}, table.state
    for p in state.players:
        llm = resources["opponent_llm" if p.name in external else "main_llm"]
        model = chat_model(
            llm, agent_name(p, p.name in external), formatter=OpenAIMultiAgentFormatter()
        )
        agents[p.name] = Agent(
            name=p.name,
            system_prompt=role_prompt(p, state, table.rules),
            model=model,
            middlewares=[TracingMiddleware(), PinnedNote(lambda name=p.name: table.note_of(name))],
            injection_config=InjectionConfig(inject_runtime_state=False),
            # a reply is one call, and one more that asks for the structured output when the
            # first gave none (AgentScope's default allows 50 + 5 calls a reply)
            react_config=ReActConfig(max_iters=1, structured_output_grace_iters=1),
        )
    return agents


@vl.rollout
async def werewolf_game(row: dict, resources: vl.Resources) -> float:
    """One game; the reward is the trained side's outcome (``row["train"]``; ``both``: the
    village's). Each side's outcome is also the final reward of its players' calls."""
    instrument()
    rules = ruleset(row.get("rules"))
    if row.get("max_rounds"):
        rules = dataclasses.replace(rules, max_rounds=int(row["max_rounds"]))
    rng = random.Random(row["seed"])
    state = deal(row["seed"])
    external = external_seats(state, row.get("external"), rng)
    count = token_counter(row.get("tokenizer"))
    history = History(count, int(row.get("history_tokens") or HISTORY_TOKENS))
    penalty = row.get("invalid_penalty")
    bonus = row.get("choice_reward")
    table = Table(
        state,
        rules,
        {},
        rng,
        history,
        invalid_penalty=INVALID_PENALTY if penalty is None else float(penalty),
        choice_reward=CHOICE_REWARD if bonus is None else float(bonus),
    )
    table.agents = _agents(table, resources, external)
    winner = await play(table)
    outcome = {}
    for side in SIDES:
        values = {**OUTCOME, **(row.get("outcome") or {}).get(side, {})}
        outcome[side] = values["draw" if winner is None else "win" if winner == side else "loss"]
        vl.emit_reward(outcome[side], name=f"outcome/{side}", agents=rf"[^/]+/{side}/.*")
    mine = [table.answers.get(p.name) for p in state.players if p.name not in external]
    choices = sum(a[0] for a in mine if a)
    at_random = sum(a[2] for a in mine if a)
    vl.emit_event(
        "game",
        winner=winner or "draw",
        rules=rules.name,
        rounds=state.round,
        decisions=table.decisions,
        fallbacks=table.fallbacks,
        lots_drawn=table.lots_drawn,
        history_dropped=history.dropped,
        invalid_outputs=table.invalid,
        context_overflows=table.overflows,
        external_seats=sorted(external),
        roles={p.name: p.role for p in state.players},
        # the share of the run's model's choices it answered legally (a charted metric)
        legal_choices=(choices - at_random) / choices if choices else None,
        answers=table.answers,  # per player: choices, invalid answers, played at random
        log=table.log,  # speeches by day and every vote, for the report's statistics
    )
    return outcome["village" if row.get("train", "village") == "both" else row["train"]]
