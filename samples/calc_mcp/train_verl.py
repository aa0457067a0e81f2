"""Train the Agent Framework + MCP calculator agent with verl on GPUs (``vl.VERL``): the same
``agent.py`` that ``run.py train`` trains with LocalRL.

    pip install -e '.[verl,agent-framework]' 'verl[vllm]==0.9.1'  # on the GPU machine(s)
    ray start --head                                               # optional on one machine
    python samples/calc_mcp/train_verl.py --model Qwen/Qwen2.5-1.5B-Instruct --preset 1gpu-40gb

Each rollout starts the MCP calculator server as a subprocess: keep ``--concurrency`` within
what the runner machines' CPUs can start. Trailing ``key=value`` arguments are verl (or
``voltrl.*``) overrides; see docs/verl.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import voltrl as vl
from voltrl.cli.verl import verl_algorithm, verl_arguments, verl_fit

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 256  # per model call; up to four round trips


def config() -> dict:
    """verl's keys for this agent, plus the ``voltrl`` section."""
    return {
        "actor_rollout_ref": {
            "actor": {"optim": {"lr": 1e-6}},
            "rollout": {"response_length": 2048, "val_kwargs": {"temperature": 0.0}},
        },
        "data": {"max_prompt_length": 1024},
        "trainer": {"test_freq": 10, "save_freq": 50},
        "voltrl": {
            # the tool loop resends the conversation: one merged row per rollout
            "trajectory": {"mode": "trajectory"},
            "rollout_weighting": True,
        },
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: the shared VERL options plus the problem counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verl_arguments(parser, model="Qwen/Qwen2.5-1.5B-Instruct", name="calc_mcp-verl")
    parser.set_defaults(concurrency=8)
    parser.add_argument("--train-tasks", type=int, default=4096)
    parser.add_argument("--val-tasks", type=int, default=128)
    return parser.parse_args(argv)


def algorithm(args: argparse.Namespace) -> vl.VERL:
    """The run's VERL algorithm (composes and validates verl's config)."""
    return verl_algorithm(args, config(), max_tokens=MAX_TOKENS)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    sys.path.insert(0, str(HERE))
    from agent import calc_agent
    from data import make_problems

    problems = make_problems(args.train_tasks + args.val_tasks, seed=args.seed)
    val, train = problems[: args.val_tasks], problems[args.val_tasks :]
    return verl_fit(args, algorithm(args), calc_agent, train, val)


if __name__ == "__main__":
    raise SystemExit(main())
