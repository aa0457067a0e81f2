"""Train the model behind the agent service with verl on GPUs (``vl.VERL``): the OpenAI
Agents SDK agent keeps running in its own FastAPI process and calls VoltRL's gateway, which
now fronts verl's vLLM replicas; the service's code does not change.

    pip install -e '.[verl,openai-agents]' 'verl[vllm]==0.9.1'  # on the GPU machine(s)
    ray start --head                                             # optional on one machine
    python samples/agent_service/train_verl.py --model Qwen/Qwen2.5-1.5B-Instruct --preset 1gpu-40gb
    python samples/agent_service/train_verl.py --service-url http://10.0.0.5:8765 \\
        --gateway-file /shared/gateway.json voltrl.gateway_host=0.0.0.0

Without ``--service-url`` the service is started here as a subprocess (as ``run.py`` does). A
service on another machine needs a gateway it can reach (``voltrl.gateway_host``) and the
gateway file on storage both see. Trailing ``key=value`` arguments are verl (or ``voltrl.*``)
overrides; see docs/verl.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import voltrl as vl
from voltrl.cli.verl import verl_algorithm, verl_arguments, verl_fit

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 256  # per model call


def config() -> dict:
    """verl's keys for this agent, plus the ``voltrl`` section."""
    return {
        "actor_rollout_ref": {
            "actor": {"optim": {"lr": 1e-6}},
            "rollout": {"response_length": 1024, "val_kwargs": {"temperature": 0.0}},
        },
        "data": {"max_prompt_length": 1024},
        "trainer": {"test_freq": 10, "save_freq": 50},
        "voltrl": {"trajectory": {"mode": "trajectory"}, "rollout_weighting": True},
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: the shared VERL options, the task counts and the service."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verl_arguments(parser, model="Qwen/Qwen2.5-1.5B-Instruct", name="agent_service-verl")
    parser.add_argument("--train-tasks", type=int, default=4096)
    parser.add_argument("--n-val", type=int, default=128, help="held-out tasks")
    parser.add_argument("--service-url", help="use this running service instead of starting one")
    parser.add_argument("--gateway-file", type=Path, help="where the service reads the gateway")
    parser.add_argument("--out", type=Path, default=Path("runs"), help="run directory root")
    return parser.parse_args(argv)


def algorithm(args: argparse.Namespace) -> vl.VERL:
    """The run's VERL algorithm (composes and validates verl's config)."""
    return verl_algorithm(args, config(), max_tokens=MAX_TOKENS)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    sys.path.insert(0, str(HERE))
    from run import agent_for, datasets

    train, val = datasets(args.seed, args.train_tasks, args.n_val)
    with agent_for(args, args.out / args.name) as agent:
        return verl_fit(args, algorithm(args), agent, train, val, run_dir=args.out)


if __name__ == "__main__":
    raise SystemExit(main())
