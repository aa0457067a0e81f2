"""Run the AutoGen calculator agent: ``dev`` against any OpenAI-compatible endpoint, or
``train`` it with LocalRL on this machine.

    python samples/autogen_calc/run.py dev --endpoint http://127.0.0.1:8000/v1 --model NAME
    python samples/autogen_calc/run.py train                  # the tiny built-in model, 2 steps
    python samples/autogen_calc/run.py train --model Qwen/Qwen2.5-0.5B-Instruct --steps 50
    python samples/autogen_calc/run.py train --loggers tensorboard  # also to TensorBoard

``voltrl train runs/<name>/train.yaml`` runs a ``train`` again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import sample_cli as cli  # noqa: E402
from agent import autogen_calc_agent  # noqa: E402
from data import make_problems, write_jsonl  # noqa: E402

import voltrl as vl  # noqa: E402


def datasets(seed: int, n_train: int, n_val: int) -> tuple[list[dict], list[dict]]:
    """Training and held-out problems from ``seed``, no question in both."""
    return cli.held_out_split(make_problems, seed, n_train, n_val)


def dev(args: argparse.Namespace) -> vl.RunResult:
    """Run the agent once per problem against ``--endpoint``, no training."""
    _, problems = datasets(args.seed, 0, args.n)
    name = cli.run_name(args, "autogen_calc-dev")
    write_jsonl(problems, args.run_dir / name / "problems.jsonl")
    result = cli.dev_run(args, autogen_calc_agent, name, problems)
    solved = result.stats.reward_mean or 0.0
    print(f"solved {solved:.1%} of {len(problems)} problems; run in {result.run_dir}")
    return result


def train(args: argparse.Namespace) -> vl.RunResult:
    """Train the agent's model with LocalRL, validating before and after."""
    train_rows, val_rows = datasets(args.seed, 500, args.n_val)
    algorithm = cli.local_rl(args)
    name = cli.run_name(args, "autogen_calc-train")
    return cli.train_run(args, algorithm, autogen_calc_agent, name, train_rows, val_rows)


def main(argv: list[str] | None = None) -> int:
    parser, sub = cli.sample_parser(__doc__)
    cli.add_commands(sub, cli.common_arguments("problem"), "problems", dev=dev, train=train)
    return cli.main_with(parser, argv, cli.run_command)


if __name__ == "__main__":
    raise SystemExit(main())
