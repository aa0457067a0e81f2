"""Train the AutoGen calculator agent with verl on GPUs (``vl.VERL``): the same ``agent.py``
that ``run.py train`` trains with LocalRL.

    pip install -e '.[verl,autogen]' 'verl[vllm]==0.9.1'   # on the GPU machine(s)
    ray start --head                                        # optional on one machine
    python samples/autogen_calc/train_verl.py --model Qwen/Qwen2.5-1.5B-Instruct --preset 1gpu-40gb

Trailing ``key=value`` arguments are verl (or ``voltrl.*``) overrides; see docs/verl.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import voltrl as vl
from voltrl.cli.verl import verl_algorithm, verl_arguments, verl_fit

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 256  # per model call; up to three tool rounds and an answer


def config() -> dict:
    """verl's keys for this agent, plus the ``voltrl`` section."""
    return {
        "actor_rollout_ref": {
            "actor": {"optim": {"lr": 1e-6}},
            "rollout": {"response_length": 1536, "val_kwargs": {"temperature": 0.0}},
        },
        "data": {"max_prompt_length": 1024},
        "trainer": {"test_freq": 10, "save_freq": 50},
        "voltrl": {
            # AutoGen resends the growing conversation: one merged row per rollout
            "trajectory": {"mode": "trajectory"},
            "rollout_weighting": True,
        },
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: the shared VERL options plus the problem counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verl_arguments(parser, model="Qwen/Qwen2.5-1.5B-Instruct", name="autogen_calc-verl")
    parser.add_argument("--train-problems", type=int, default=4096)
    parser.add_argument("--val-problems", type=int, default=128)
    return parser.parse_args(argv)


def algorithm(args: argparse.Namespace) -> vl.VERL:
    """The run's VERL algorithm (composes and validates verl's config)."""
    return verl_algorithm(args, config(), max_tokens=MAX_TOKENS)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    sys.path.insert(0, str(HERE))
    from run import autogen_calc_agent, datasets

    train, val = datasets(args.seed, args.train_problems, args.val_problems)
    return verl_fit(args, algorithm(args), autogen_calc_agent, train, val)


if __name__ == "__main__":
    raise SystemExit(main())
