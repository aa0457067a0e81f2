"""Train the SQL agent with verl on GPUs (``vl.VERL``), optimising only its ``write`` and
``rewrite`` agents, as ``run.py train`` does with LocalRL.

    pip install -e '.[verl,langchain]' 'verl[vllm]==0.9.1'  # on the GPU machine(s)
    ray start --head                                        # optional on one machine
    python samples/sql_agent/train_verl.py --model Qwen/Qwen2.5-1.5B-Instruct --preset 1gpu-40gb

Trailing ``key=value`` arguments are verl (or ``voltrl.*``) overrides; see docs/verl.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import voltrl as vl
from voltrl.cli.verl import verl_algorithm, verl_arguments, verl_fit

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 384  # per model call (a query, or a check of one)
AGENT_FILTER = "write|rewrite"  # agent.AGENT_FILTER: the check agent is not trained


def config() -> dict:
    """verl's keys for this agent, plus the ``voltrl`` section."""
    return {
        "actor_rollout_ref": {
            "actor": {"optim": {"lr": 1e-6}, "ppo_mini_batch_size": 8},
            "rollout": {"response_length": MAX_TOKENS, "val_kwargs": {"temperature": 0.0}},
        },
        # the schema and the question make long prompts; 24 training questions: 8 per step
        "data": {"max_prompt_length": 2048, "train_batch_size": 8},
        "trainer": {"test_freq": 5, "save_freq": 25},
        "voltrl": {
            # one row per write/rewrite call (each node builds its own prompt)
            "trajectory": {"mode": "transition", "agent_filter": AGENT_FILTER},
            "rollout_weighting": True,
        },
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: the shared VERL options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verl_arguments(parser, model="Qwen/Qwen2.5-1.5B-Instruct", steps=100, name="sql-verl")
    return parser.parse_args(argv)


def algorithm(args: argparse.Namespace) -> vl.VERL:
    """The run's VERL algorithm (composes and validates verl's config)."""
    return verl_algorithm(args, config(), max_tokens=MAX_TOKENS)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    sys.path.insert(0, str(HERE))
    from run import load_agent_module, questions

    agent = load_agent_module()
    assert agent.AGENT_FILTER == AGENT_FILTER
    return verl_fit(args, algorithm(args), agent.sql_agent, questions("train"), questions("val"))


if __name__ == "__main__":
    raise SystemExit(main())
