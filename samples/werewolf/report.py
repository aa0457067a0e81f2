"""The report a werewolf run ends with: per group of games (``train``, ``val before``,
``val after``) the winners, the wolves' win rate with its 95% interval, the village's, the draw
rate, the legal answers' share (overall and per role of the seats on the run's model), what
the players did (:func:`behaviour`), and per game the rounds, choices, calls, tokens, invalid
answers and refused prompts; and the statistics the learning recipe reports with them
(:func:`wilson`, :func:`two_proportions`, :func:`summary`)."""

from __future__ import annotations

import asyncio
import math
import re
from collections import Counter
from pathlib import Path
from statistics import mean
from typing import Any

import voltrl as vl
from voltrl.observability.events import events
from voltrl.store import open_store


async def game_report(store_path: Path, rollouts: list[vl.types.Rollout]) -> list[dict]:
    """Per game: its ``game`` event (None for a game not played to its end: cancelled or
    failed), its status, its deal's seed, the number and tokens of its calls, and when it was
    played:
    ``mode`` (``train`` or ``val``) and the trained weights it was played with (``weights``,
    the updates LocalRL had served; None where unknown)."""
    store = open_store(store_path, existing=True, read_only=True)
    weights: dict[int, int | None] = {}
    try:
        out = []
        for r in rollouts:
            spans = await store.get_spans(r.rollout_id, r.final_attempt_id)
            calls = await store.get_llm_calls(r.rollout_id, r.final_attempt_id)
            version = r.resources_version or 0
            if version not in weights:
                resources = await store.get_resources(version)
                has = resources is not None and "main_llm" in resources
                llm = resources["main_llm"] if has else None
                weights[version] = getattr(llm, "weights_version", None)
            out.append(
                {
                    "game": next((e.attributes for e in events(spans) if e.name == "game"), None),
                    "status": r.status,
                    "mode": r.mode,
                    "deal": r.task.input.get("seed"),
                    "version": version,
                    "weights": weights[version],
                    "calls": len(calls),
                    "prompt_tokens": sum(len(c.prompt_token_ids or ()) for c in calls),
                    "response_tokens": sum(len(c.response_token_ids or ()) for c in calls),
                }
            )
        return out
    finally:
        await store.close()


def when_played(games: list[dict]) -> None:
    """Splits ``val`` into ``val before`` and ``val after`` training (in place): by the
    weights they were played with where known (a resumed run's repeated first validation is
    still "before"), else by resources version."""
    val = [g for g in games if g["mode"] == "val"]
    key = "weights" if all(g["weights"] is not None for g in val) else "version"
    first = min((g[key] for g in val), default=None)
    if len({g[key] for g in val}) > 1:
        for g in val:
            g["mode"] = "val before" if g[key] == first else "val after"


def wilson(wins: int, games: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a win rate (95% for ``z`` 1.96)."""
    if games == 0:
        return 0.0, 1.0
    p = wins / games
    centre = (p + z * z / (2 * games)) / (1 + z * z / games)
    half = z * math.sqrt(p * (1 - p) / games + z * z / (4 * games * games)) / (1 + z * z / games)
    return max(0.0, centre - half), min(1.0, centre + half)


def two_proportions(wins_a: int, games_a: int, wins_b: int, games_b: int) -> tuple[float, float]:
    """The two-proportion z-test of ``wins_a / games_a`` against ``wins_b / games_b`` (pooled
    variance): ``(z, two-sided p)``; z > 0 when b is higher. ``(0.0, 1.0)`` when either has no
    games or both rates are 0 or 1 (nothing to tell apart)."""
    if not games_a or not games_b:
        return 0.0, 1.0
    pooled = (wins_a + wins_b) / (games_a + games_b)
    se = math.sqrt(pooled * (1 - pooled) * (1 / games_a + 1 / games_b))
    if se == 0:
        return 0.0, 1.0
    z = (wins_b / games_b - wins_a / games_a) / se
    return z, math.erfc(abs(z) / math.sqrt(2))


def legal_by_role(games: list[dict]) -> dict[str, tuple[int, int, int]]:
    """Per role, ``(legal answers, answers, choices)`` of the seats on the run's model
    (``main_llm``; external seats are left out), from each game's ``answers``: a choice played
    at random had no legal answer, every other had one (at the first try or a retry), and each
    invalid answer counts too."""
    out: dict[str, list[int]] = {}
    for g in games:
        external = set(g.get("external_seats") or ())
        for player, (choices, invalid, fallbacks) in (g.get("answers") or {}).items():
            if player in external:
                continue
            counts = out.setdefault(g["roles"][player], [0, 0, 0])
            counts[0] += choices - fallbacks
            counts[1] += choices - fallbacks + invalid
            counts[2] += choices
    return {role: (counts[0], counts[1], counts[2]) for role, counts in sorted(out.items())}


SEER_CLAIM = re.compile(r"\bI am the seer\b", re.IGNORECASE)
WEREWOLF_NAMED = re.compile(r"\b(\w+) is a werewolf\b", re.IGNORECASE)


def behaviour(games: list[dict]) -> dict[str, tuple[int, int]]:
    """What the players did, from each game's ``log``, as ``(times, out of)``:

    - ``seer revealed``: games in which the seer said ``I am the seer`` by day;
    - ``wolves bite the revealed seer``: nights the werewolves voted to attack the seer, of the
      nights she was alive after saying so;
    - ``village votes a revealed werewolf``: day ballots of the village naming a werewolf the
      seer had named by day (``PlayerN is a werewolf``), of the ballots cast while one such
      werewolf was alive.
    """
    revealed_games = bites = nights = hits = ballots = 0
    for g in games:
        roles = g["roles"]
        seer = next((p for p, r in roles.items() if r == "seer"), None)
        claimed, named = False, set()
        for entry in g.get("log") or ():
            if entry["kind"] == "speech" and entry["who"] == seer:
                claimed = claimed or bool(SEER_CLAIM.search(entry["text"]))
                named |= {
                    w for w in WEREWOLF_NAMED.findall(entry["text"]) if roles.get(w) == "werewolf"
                }
            elif entry["kind"] == "vote" and entry["when"].startswith("Night"):
                if claimed and seer in entry["alive"]:
                    nights += 1
                    bites += entry["out"] == seer
            elif entry["kind"] == "vote":
                wolves = named & set(entry["alive"])
                for voter, target in entry["ballots"].items() if wolves else ():
                    if roles[voter] != "werewolf":
                        ballots += 1
                        hits += target in wolves
        revealed_games += claimed
    return {
        "seer revealed": (revealed_games, len(games)),
        "wolves bite the revealed seer": (bites, nights),
        "village votes a revealed werewolf": (hits, ballots),
    }


def summary(games: list[dict], side: str) -> dict[str, Any]:
    """A group of games played to their end (``game_report``'s rows with their ``game``
    event merged in) for the side ``side``: its wins, win rate and 95% Wilson interval, the
    draws, the legal answers overall and per role (:func:`legal_by_role`), the choices answered
    legally (``legal_choices``: at the first try or the retry; the others were played at
    random) and :func:`behaviour`."""
    wins = sum(g["winner"] == side for g in games)
    draws = sum(g["winner"] == "draw" for g in games)
    roles = legal_by_role(games)
    legal, answers, choices = (sum(x[i] for x in roles.values()) for i in (0, 1, 2))
    return {
        "games": len(games),
        "wins": wins,
        "win_rate": wins / len(games) if games else None,
        "ci95": list(wilson(wins, len(games))),
        "draws": draws,
        "draw_rate": draws / len(games) if games else None,
        "legal": legal / answers if answers else None,
        "legal_choices": legal / choices if choices else None,
        "legal_by_role": {r: (a / b if b else None) for r, (a, b, _) in roles.items()},
        "answers_by_role": {r: [a, b] for r, (a, b, _) in roles.items()},
        "behaviour": {k: list(v) for k, v in behaviour(games).items()},
    }


def print_report(result: vl.RunResult) -> None:
    """Per group of games: winners (and the draws: games the round cap ended), the wolves' win
    rate with its interval, the village's, the share of the choices' answers that were legal
    (a fallback's tries were all invalid), rounds, choices, calls and tokens per game, invalid
    answers, refused prompts and history dropped; games not played to their end are named, not
    counted."""
    games = asyncio.run(game_report(result.run_dir / "store.sqlite", result.rollouts))
    when_played(games)
    for mode in sorted({g["mode"] for g in games}, key=lambda m: (m != "train", m != "val before")):
        unfinished = Counter(g["status"] for g in games if g["mode"] == mode and not g["game"])
        some = [{**g, **g["game"]} for g in games if g["mode"] == mode and g["game"]]
        skipped = f" ({dict(unfinished)} not played to the end, not counted)" if unfinished else ""
        if not some:
            print(f"{mode}: no game played to the end{skipped}")
            continue
        winners = Counter(g["winner"] for g in some)
        low, high = wilson(winners["wolves"], len(some))
        legal = sum(g.get("decisions", 0) - g.get("fallbacks", 0) for g in some)
        answers = legal + sum(g.get("invalid_outputs", 0) for g in some)
        print(
            f"{mode}: {len(some)} game(s){skipped}, winners {dict(winners)}: the wolves won "
            f"{winners['wolves'] / len(some):.0%} (95% CI {low:.0%}-{high:.0%}), the village "
            f"{winners['village'] / len(some):.0%}, draw rate "
            f"{winners['draw'] / len(some):.0%} (ended by the round cap); legal answers "
            f"{legal / max(answers, 1):.0%} ({legal} of {answers}); per game "
            f"{mean(g.get('rounds', 0) for g in some):.1f} rounds, "
            f"{mean(g.get('decisions', 0) for g in some):.1f} choices "
            f"({mean(g.get('fallbacks', 0) for g in some):.1f} played at random), "
            f"{mean(g['calls'] for g in some):.0f} calls, "
            f"{mean(g['prompt_tokens'] for g in some):.0f} prompt + "
            f"{mean(g['response_tokens'] for g in some):.0f} generated tokens, "
            f"{mean(g.get('invalid_outputs', 0) for g in some):.1f} invalid answers, "
            f"{mean(g.get('context_overflows', 0) for g in some):.1f} refused prompts, "
            f"{mean(g.get('history_dropped', 0) for g in some):.0f} messages dropped from "
            "histories"
        )
        if roles := legal_by_role(some):
            shown = ", ".join(
                f"{r} {a / max(b, 1):.0%} ({a} of {b})" for r, (a, b, _) in roles.items()
            )
            print(f"  legal answers by role (the seats on the run's model): {shown}")
        if any(g.get("log") is not None for g in some):
            facts = ", ".join(
                f"{what} {k / n:.0%} ({k} of {n})" if n else f"{what}: no occasion"
                for what, (k, n) in behaviour(some).items()
            )
            print(f"  {facts}")
