"""The report a werewolf run ends with: per group of games (``train``, ``val before``,
``val after``) the winners, the wolves' win rate with its 95% interval, the village's, the draw
rate, the legal answers' share, and per game the rounds, choices, calls, tokens, invalid
answers and refused prompts."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from pathlib import Path
from statistics import mean

import voltrl as vl
from voltrl.store import open_store


async def game_report(store_path: Path, rollouts: list[vl.types.Rollout]) -> list[dict]:
    """Per game: its ``game`` event (None for a game not played to its end: cancelled or
    failed), its status, the number and tokens of its calls, and when it was played:
    ``mode`` (``train`` or ``val``) and the trained weights it was played with (``weights``,
    the updates LocalRL had served; None where unknown)."""
    store = open_store(store_path)
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
                    "game": next((s.attributes for s in spans if s.name == "game"), None),
                    "status": r.status,
                    "mode": r.mode,
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
