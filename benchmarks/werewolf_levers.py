"""Which lever moves a werewolf win rate? RL of one side from one warm start, each lever set
on the command line, the win rate measured before and after on the recipe's held-out deals.

The werewolf recipe (``samples/werewolf/recipe.py``) warms a student up on the scripted
teacher's games, then trains one side against the teacher playing the other. Its first runs
moved nothing (README.md, "The learning recipe"); this script tries what the recipe leaves
fixed, each run from the same warm start (``recipe_runner.warm_up``: done once per seed and
reused), so that runs differ only by their levers:

- ``--steps``, ``--group-size``, ``--games-per-step``: a longer run, larger GRPO groups;
- ``--train-temperature``: training rollouts sampled hotter (or colder) than validation's
  temperature 1;
- ``--choice-reward``: a reward on each call that votes out, bites, poisons or shoots a
  player of the other side (``game_rows(choice_reward=...)``), beside the game's outcome;
- ``--entropy-coef``, ``--kl-coef``, ``--lr``, ``--invalid-penalty``: the update's and the
  penalty's settings (default: the recipe's).

Each run appends its row (the levers, the recipe's figures: win rates with 95% Wilson
intervals, the two-proportion test, legal answers, behaviour, groups; the policy's entropy
per update; minutes) to ``<out>/learning/werewolf-levers.jsonl`` and prints the table of every
row so far (``werewolf-levers.md``). In the AgentScope environment::

    .venv-agentscope/bin/python benchmarks/werewolf_levers.py --side wolves --steps 40 \\
        --train-temperature 1.3
    .venv-agentscope/bin/python benchmarks/werewolf_levers.py --side village --choice-reward 0.3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "samples"), str(ROOT / "samples" / "werewolf"), str(ROOT / "benchmarks")]

LEVERS = (
    "steps",
    "group_size",
    "games_per_step",
    "train_temperature",
    "choice_reward",
    "invalid_penalty",
    "entropy_coef",
    "kl_coef",
    "lr",
)
"""The levers a row records, as ``argparse`` names them."""


def rl_settings(recipe: Any, levers: dict[str, Any]) -> dict[str, Any]:
    """``recipe.rl`` with ``levers`` applied (None: the recipe's): the schedule, the training
    sampling (validation keeps the recipe's) and the update."""
    rl = dict(recipe.rl)
    schedule = dict(rl["schedule"])
    steps = levers["steps"] or schedule["steps"]
    group = levers["group_size"] or schedule["group_size"]
    games = levers["games_per_step"] or schedule["tasks_per_step"] * schedule["group_size"]
    if games % group:
        raise SystemExit(f"--games-per-step {games} is not a multiple of --group-size {group}")
    rl["schedule"] = {**schedule, "steps": steps, "tasks_per_step": games // group,
                      "group_size": group}  # fmt: skip
    rl["validation"] = {**rl["validation"], "every": steps}
    if levers["train_temperature"] is not None:
        rl["sampling"] = {**rl["sampling"], "temperature": levers["train_temperature"]}
    update = dict(rl["update"])
    for key in ("entropy_coef", "kl_coef", "lr"):
        if levers[key] is not None:
            update[key] = levers[key]
    rl["update"] = update
    return rl


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One RL run of ``args.side`` from the seed's warm start with ``args``' levers; its row."""
    from learning import load_recipe
    from recipe_runner import warm_up
    from transformers import AutoTokenizer

    import voltrl as vl

    recipe = load_recipe("werewolf", args.model, args.side)
    levers = {k: getattr(args, k) for k in LEVERS}
    rl = rl_settings(recipe, levers)  # before the warm-up: its errors come first
    warmed, warm_minutes = warm_up(recipe, args.seed, args.out)
    game = {k: levers[k] for k in ("choice_reward", "invalid_penalty") if levers[k] is not None}
    _, train, val = ([{**row, **game} for row in rows] for rows in recipe.tasks(args.seed))
    val = val[: args.val_deals] if args.val_deals else val
    started = time.time()
    algorithm = vl.LocalRL(
        str(warmed),
        tokenizer=AutoTokenizer.from_pretrained(warmed),
        seed=args.seed,
        **rl,
    )
    assert recipe.resources_in is not None and recipe.measure is not None
    with recipe.resources_in(args.seed) as resources:  # the teacher, for the other side
        trainer = vl.Trainer(
            algorithm,
            n_runners=1,
            max_concurrency=recipe.concurrency,
            run_dir=args.out,
            name=args.name or f"werewolf-{args.side}-levers-seed{args.seed}",
            resources=resources,
        )
        result = trainer.fit(recipe.agent, train, val)
    updates = [h for h in algorithm.history if "batch/rows" in h]
    return {
        "side": args.side,
        "model": args.model,
        "seed": args.seed,
        "levers": levers,
        **recipe.measure(result, algorithm.history),
        "entropy": [h.get("update/entropy") for h in updates],
        "warm_start": str(warmed),
        "warm_minutes": warm_minutes,
        "minutes": (time.time() - started) / 60,
        "run_dir": str(result.run_dir),
    }


def lever_text(levers: dict[str, Any]) -> str:
    """The levers a row set (the others were the recipe's), as ``name value`` pairs."""
    return ", ".join(f"{k} {v:g}" for k, v in levers.items() if v is not None) or "the recipe's"


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per run: its levers, the win rate before → after with 95% intervals, the
    test, the choices answered legally, the groups whose games did not all end alike, the
    policy's entropy at the first and last update, and minutes."""
    lines = [
        "| side | seed | levers | win before (95% CI) | after (95% CI) | z, p "
        "| legal choices before / after | groups mixed | entropy first / last | minutes |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        b, a, g = r["before"], r["after"], r["rl_groups"]

        def rate(s: dict[str, Any]) -> str:
            lo, hi = s["ci95"]
            return f"{s['win_rate']:.0%} ({lo:.0%}-{hi:.0%}) of {s['games']}"

        def legal(s: dict[str, Any]) -> str:
            return "-" if s.get("legal_choices") is None else f"{s['legal_choices']:.1%}"

        entropy = [e for e in r["entropy"] if e is not None]
        spread = f"{entropy[0]:.3f} / {entropy[-1]:.3f}" if entropy else "-"
        lines.append(
            f"| {r['side']} | {r['seed']} | {lever_text(r['levers'])} | {rate(b)} | {rate(a)} "
            f"| {r['z']:+.2f}, {r['p_value']:.2f} | {legal(b)} / {legal(a)} "
            f"| {g['groups_mixed']} of {g['groups']} | {spread} | {r['minutes']:.1f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=("wolves", "village"), default="wolves")
    parser.add_argument(
        "--model", choices=("tiny", "smollm2-135m-instruct"), default="tiny",
        help="the student (default: tiny)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the warm start's and RL's seed")
    parser.add_argument("--out", type=Path, default=Path("runs"), help="default: runs")
    parser.add_argument("--name", default=None, help="the run's name (default: numbered)")
    parser.add_argument("--val-deals", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--steps", type=int, default=None, help="RL updates")
    parser.add_argument("--group-size", type=int, default=None, help="games of a deal a step")
    parser.add_argument("--games-per-step", type=int, default=None, help="games a step")
    parser.add_argument(
        "--train-temperature", type=float, default=None,
        help="the training rollouts' sampling temperature (validation keeps the recipe's)",
    )  # fmt: skip
    parser.add_argument(
        "--choice-reward", type=float, default=None,
        help="the reward of a call that votes out, bites, poisons or shoots the other side",
    )  # fmt: skip
    parser.add_argument("--invalid-penalty", type=float, default=None)
    parser.add_argument("--entropy-coef", type=float, default=None)
    parser.add_argument("--kl-coef", type=float, default=None)
    parser.add_argument("--lr", type=float, default=None)
    args = parser.parse_args(argv)
    for option in ("steps", "group_size", "games_per_step", "val_deals"):
        if (value := getattr(args, option)) is not None and value < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1 (got {value})")
    from agent import reward_errors  # the werewolf sample's

    for wrong in reward_errors(args.invalid_penalty, args.choice_reward):
        parser.error(f"--{wrong.replace('_', '-')}")
    row = run(args)
    report = args.out / "learning"
    report.mkdir(parents=True, exist_ok=True)
    with (report / "werewolf-levers.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    rows = [
        json.loads(line) for line in (report / "werewolf-levers.jsonl").read_text().splitlines()
    ]
    lines = table_lines(rows)
    (report / "werewolf-levers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
