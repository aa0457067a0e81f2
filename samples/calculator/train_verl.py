"""Train the calculator agent with verl on GPUs (``vl.VERL``), the same ``agent.py`` as the demo.

    pip install -e '.[verl]' 'verl[vllm]==0.9.1'           # on the GPU machine(s)
    ray start --head                                        # optional on one machine
    python samples/calculator/train_verl.py --model Qwen/Qwen2.5-1.5B-Instruct --preset 1gpu-40gb
    python samples/calculator/train_verl.py --model Qwen/Qwen2.5-7B-Instruct --preset 8gpu \\
        actor_rollout_ref.actor.optim.lr=5e-7 trainer.logger='[console,wandb]'

Trailing ``key=value`` arguments are verl (or ``voltrl.*``) overrides; ``--config`` takes a
YAML file of the same keys. See docs/verl.md for GPU memory needs and every key.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import voltrl as vl
from voltrl.cli.verl import verl_algorithm, verl_arguments, verl_fit

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 256  # per model call; at most three calls fit rollout.response_length


def config() -> dict:
    """verl's keys for this agent, plus the ``voltrl`` section."""
    return {
        "actor_rollout_ref": {
            "actor": {"optim": {"lr": 1e-6}},
            "rollout": {"response_length": 1024, "val_kwargs": {"temperature": 0.0}},
        },
        "data": {"max_prompt_length": 512},
        "trainer": {"test_freq": 10, "save_freq": 50, "val_before_train": True},
        # one row per rollout: the tool result joins the response as context (mask 0)
        "voltrl": {"trajectory": {"mode": "trajectory"}, "rollout_weighting": True},
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: the shared VERL options plus the task counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verl_arguments(parser, model="Qwen/Qwen2.5-1.5B-Instruct", name="calculator-verl")
    parser.add_argument("--train-tasks", type=int, default=4096)
    parser.add_argument("--val-tasks", type=int, default=192)
    return parser.parse_args(argv)


def algorithm(args: argparse.Namespace) -> vl.VERL:
    """The run's VERL algorithm (composes and validates verl's config)."""
    return verl_algorithm(args, config(), max_tokens=MAX_TOKENS)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    sys.path.insert(0, str(HERE))
    from agent import calculator_agent
    from data import make_tasks

    train = make_tasks(args.train_tasks, seed=args.seed)
    val = make_tasks(args.val_tasks, seed=args.seed + 1)
    return verl_fit(args, algorithm(args), calculator_agent, train, val)


if __name__ == "__main__":
    raise SystemExit(main())
