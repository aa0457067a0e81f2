"""What the ``run.py`` scripts of the samples share: the ``dev`` and ``train`` options, the
held-out split, a ``dev`` run against an endpoint and a LocalRL ``train`` run on this machine.

A sample's ``run.py`` puts this directory on ``sys.path`` and imports it by name.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import voltrl as vl

MakeRows = Callable[..., list[dict[str, Any]]]


def held_out_split(
    make: MakeRows, seed: int, n_train: int, n_val: int
) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows of ``make(n, seed=...)``, no question in both."""
    val = make(n_val, seed=10_000 + seed)
    held_out = {row["question"] for row in val}
    train = [r for r in make(n_train, seed=seed) if r["question"] not in held_out]
    return train, val


def common_arguments(what: str) -> argparse.ArgumentParser:
    """The options ``dev`` and ``train`` share (a parent parser); ``what`` names the rows."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--seed", type=int, default=0, help=f"{what} generation seed")
    common.add_argument("--out", type=Path, default=Path("runs"), help="run directory root")
    common.add_argument("--concurrency", type=int, default=8, help="rollouts at a time")
    return common


def add_commands(
    parser: argparse.ArgumentParser,
    common: argparse.ArgumentParser,
    what: str,
    *,
    dev: Callable[[argparse.Namespace], Any],
    train: Callable[[argparse.Namespace], Any],
) -> None:
    """The ``dev`` and ``train`` subcommands, calling ``dev(args)`` or ``train(args)``."""
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dev", parents=[common], help="run the agent against an endpoint")
    d.add_argument("--endpoint", required=True, help="OpenAI-compatible base URL (.../v1)")
    d.add_argument("--model", required=True, help="model name the endpoint serves")
    d.add_argument("--api-key", default="EMPTY")
    d.add_argument("--n", type=int, default=16, help=f"{what} to run")
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--max-tokens", type=int, default=512)
    d.add_argument(
        "--no-token-ids",
        action="store_true",
        help="do not ask the endpoint for token ids (hosted APIs that reject the field)",
    )
    d.set_defaults(run=dev)

    t = sub.add_parser("train", parents=[common], help="train with LocalRL on this machine")
    t.add_argument("--model", help="model path or hub name (default: the tiny random model)")
    t.add_argument("--steps", type=int, default=2, help="policy updates")
    t.add_argument("--tasks-per-step", type=int, default=4)
    t.add_argument("--group-size", type=int, default=4)
    t.add_argument("--n-val", type=int, default=8, help=f"held-out {what}")
    t.add_argument("--max-tokens", type=int, default=64)
    t.set_defaults(run=train)


def dev_run(args: argparse.Namespace, agent: Any, name: str, rows: list[dict]) -> vl.RunResult:
    """Run ``agent`` once per row against ``--endpoint``, no training."""
    sampling = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    llm = vl.LLM(
        endpoint=args.endpoint, model=args.model, api_key=args.api_key, sampling_parameters=sampling
    )
    trainer = vl.Trainer(
        n_runners=1,
        max_concurrency=args.concurrency,
        resources={"main_llm": llm},
        run_dir=args.out,
        name=name,
        request_token_ids=not args.no_token_ids,
    )
    return trainer.dev(agent, rows)


def local_rl(args: argparse.Namespace) -> vl.LocalRL:
    """LocalRL on ``--model`` (or the tiny model), one merged row per rollout, validating
    before the first update and after the last."""
    from voltrl.algorithms.local.tiny import tiny_or_named
    from voltrl.trajectory import TrajectoryConfig

    sampling = {"temperature": 1.0, "max_tokens": args.max_tokens}
    return vl.LocalRL(
        **tiny_or_named(args.model, seed=args.seed),
        steps=args.steps,
        tasks_per_step=args.tasks_per_step,
        group_size=args.group_size,
        sampling=sampling,
        val_sampling={**sampling, "temperature": 0.0},
        val_every=args.steps,
        trajectory=TrajectoryConfig(mode="trajectory"),
        seed=args.seed,
    )


def train_run(
    args: argparse.Namespace,
    algorithm: vl.LocalRL,
    agent: Any,
    name: str,
    train: list[dict],
    val: list[dict],
) -> vl.RunResult:
    """Train ``agent``'s model with ``algorithm``; prints held-out reward before and after."""
    trainer = vl.Trainer(
        algorithm, n_runners=1, max_concurrency=args.concurrency, run_dir=args.out, name=name
    )
    result = trainer.fit(agent, train, val)
    val_reward = [h["val/reward_mean"] for h in algorithm.history if "val/reward_mean" in h]
    if val_reward:
        before, after = val_reward[0], val_reward[-1]
        print(f"held-out reward: {before:.1%} before, {after:.1%} after; run in {result.run_dir}")
    return result
