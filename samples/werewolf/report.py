"""The report a werewolf run ends with: per group of games (``train``, ``val before``,
``val after``) the winners, the wolves' win rate with its 95% interval, the draw rate, and per
game the rounds, choices, calls, tokens, invalid answers and refused prompts."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from pathlib import Path
from statistics import mean

import voltrl as vl
from voltrl.store import open_store


async def game_report(store_path: Path, rollouts: list[vl.types.Rollout]) -> list[dict]:
    """Per game: its ``game`` event, the number and tokens of its calls, and when it was
    played (``train``; ``val`` before or after training)."""
    store = open_store(store_path)
    try:
        out = []
        for r in rollouts:
            spans = await store.get_spans(r.rollout_id, r.final_attempt_id)
            calls = await store.get_llm_calls(r.rollout_id, r.final_attempt_id)
            [game] = [s.attributes for s in spans if s.name == "game"] or [{"winner": r.status}]
            out.append(
                {
                    **game,
                    "mode": r.mode,
                    "version": r.resources_version or 0,
                    "calls": len(calls),
                    "prompt_tokens": sum(len(c.prompt_token_ids or ()) for c in calls),
                    "response_tokens": sum(len(c.response_token_ids or ()) for c in calls),
                }
            )
        return out
    finally:
        await store.close()


def wilson(wins: int, games: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a win rate (95% for ``z`` 1.96)."""
    if games == 0:
        return 0.0, 1.0
    p = wins / games
    centre = (p + z * z / (2 * games)) / (1 + z * z / games)
    half = z * math.sqrt(p * (1 - p) / games + z * z / (4 * games * games)) / (1 + z * z / games)
    return max(0.0, centre - half), min(1.0, centre + half)


def print_report(result: vl.RunResult) -> None:
    """Winners (and the draws: games the round cap ended), rounds, calls and tokens per game,
    invalid answers and refused prompts."""
    games = asyncio.run(game_report(result.run_dir / "store.sqlite", result.rollouts))
    val_versions = sorted({g["version"] for g in games if g["mode"] == "val"})
    for g in games:
        if g["mode"] == "val" and len(val_versions) > 1:
            g["mode"] = "val before" if g["version"] == val_versions[0] else "val after"
    for mode in sorted({g["mode"] for g in games}, key=lambda m: (m != "train", m != "val before")):
        some = [g for g in games if g["mode"] == mode]
        winners = Counter(g["winner"] for g in some)
        low, high = wilson(winners["wolves"], len(some))
        print(
            f"{mode}: {len(some)} game(s), winners {dict(winners)}: the wolves won "
            f"{winners['wolves'] / len(some):.0%} (95% CI {low:.0%}-{high:.0%}), draw rate "
            f"{winners['draw'] / len(some):.0%} (ended by the round cap); per game "
            f"{mean(g.get('rounds', 0) for g in some):.1f} rounds, "
            f"{mean(g.get('decisions', 0) for g in some):.0f} choices "
            f"({mean(g.get('fallbacks', 0) for g in some):.0f} played at random), "
            f"{mean(g['calls'] for g in some):.0f} calls, "
            f"{mean(g['prompt_tokens'] for g in some):.0f} prompt + "
            f"{mean(g['response_tokens'] for g in some):.0f} generated tokens, "
            f"{mean(g.get('invalid_outputs', 0) for g in some):.1f} invalid answers, "
            f"{mean(g.get('context_overflows', 0) for g in some):.1f} refused prompts"
        )
