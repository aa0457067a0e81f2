"""The command line the samples' ``train_verl.py`` scripts share.

::

    parser = verl_arguments(argparse.ArgumentParser(), model="Qwen/Qwen2.5-1.5B-Instruct")
    args = parser.parse_args()
    algorithm = verl_algorithm(args, {"voltrl": {"trajectory": {"mode": "trajectory"}}})
    verl_fit(args, algorithm, agent, train_rows, val_rows)  # trains; prints the run directory

Options: ``--model``, ``--preset``, ``--config`` (a YAML of verl keys, replacing the script's
own config), ``--steps``, ``--runners``, ``--concurrency``, ``--name`` (the run's name: running
again resumes it), ``--seed``, and trailing ``key=value`` overrides of verl's or ``voltrl.*``
keys.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl.algorithms.verl.algorithm import VERL
from voltrl.algorithms.verl.config import PRESETS

if TYPE_CHECKING:
    from voltrl.runtime import RunResult


def verl_arguments(
    parser: argparse.ArgumentParser,
    *,
    model: str,
    preset: str = "1gpu-40gb",
    steps: int = 200,
    name: str = "verl",
) -> argparse.ArgumentParser:
    """Add the shared VERL options to ``parser`` (see the module docstring)."""
    parser.add_argument("--model", default=model, help="hub name or path of the model")
    parser.add_argument("--preset", default=preset, choices=sorted(PRESETS))
    parser.add_argument("--config", type=Path, default=None, help="a YAML of verl keys")
    parser.add_argument("--steps", type=int, default=steps, help="policy updates")
    parser.add_argument("--runners", type=int, default=4, help="runner processes")
    parser.add_argument("--concurrency", type=int, default=32, help="rollouts per runner")
    parser.add_argument("--name", default=name, help="run name (running again resumes it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="key=value verl or voltrl.* overrides")
    return parser


def verl_algorithm(
    args: argparse.Namespace,
    config: dict[str, Any],
    *,
    sampling: dict[str, Any] | None = None,
    val_sampling: dict[str, Any] | None = None,
    max_tokens: int | None = None,
) -> VERL:
    """:class:`VERL` from the parsed options and a script's own ``config`` (verl keys plus
    ``voltrl``); ``--model`` and ``--steps`` are applied on top, overrides last.
    ``max_tokens`` caps each model call, in training and validation alike."""
    if max_tokens is not None:
        sampling = {"max_tokens": max_tokens, **(sampling or {})}
        val_sampling = {"max_tokens": max_tokens, **(val_sampling or {})}
    source: Any = args.config if args.config is not None else config
    overrides = [
        f"actor_rollout_ref.model.path={args.model}",
        f"trainer.total_training_steps={args.steps}",
        *args.overrides,
    ]
    return VERL(
        source,
        overrides=overrides,
        preset=args.preset,
        sampling=sampling,
        val_sampling=val_sampling,
    )


def verl_fit(
    args: argparse.Namespace,
    algorithm: VERL,
    agent: Any,
    train: list[dict[str, Any]],
    val: list[dict[str, Any]],
    *,
    report: Callable[[RunResult], None] | None = None,
    **trainer: Any,
) -> int:
    """Train ``agent`` with ``algorithm`` on ``--runners`` runners of ``--concurrency`` rollouts
    as run ``--name`` (``trainer`` adds :class:`voltrl.Trainer` arguments); prints the run
    directory (after ``report(result)``, if given) and returns the script's exit status."""
    from voltrl.runtime import Trainer

    result = Trainer(
        algorithm,
        n_runners=args.runners,
        max_concurrency=args.concurrency,
        name=args.name,
        rollout_timeout_s=600,
        **trainer,
    ).fit(agent, train, val_dataset=val)
    if report is not None:
        report(result)
    print(f"run directory: {result.run_dir}")
    return 0
