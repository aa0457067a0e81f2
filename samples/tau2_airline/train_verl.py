"""Train the airline assistant with verl on one 80 GB GPU (``vl.VERL``), the customer played
by a model verl does not train, as ``run.py train`` does with LocalRL.

    pip install -e '.[verl,agent-framework]' 'verl[vllm]==0.9.1'     # on the GPU machine
    export TAU2_DATA_DIR=...       # tau2-bench's data, or `run.py generate --out DIR`
    python samples/tau2_airline/train_verl.py --model Qwen/Qwen2.5-1.5B-Instruct \\
        --user-endpoint https://api.openai.com/v1 --user-model gpt-4.1-mini \\
        --user-api-key-env OPENAI_API_KEY

Without ``--user-endpoint`` the scripted customer plays (a smoke test; learning the real task
needs an LLM customer). Trailing ``key=value`` arguments are verl (or ``voltrl.*``)
overrides; see docs/verl.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import voltrl as vl
from voltrl.cli.verl import verl_algorithm, verl_arguments, verl_fit

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 512  # per model call: one assistant message or tool call
AGENT_FILTER = "assistant"  # agent.AGENT_FILTER: the customer is never trained


def config() -> dict:
    """verl's keys for this agent, plus the ``voltrl`` section."""
    return {
        "actor_rollout_ref": {
            "actor": {"optim": {"lr": 1e-6}},
            # a merged row holds the whole conversation after the first prompt: every
            # assistant turn, tool result and customer turn (mask 0 but for the assistant's)
            "rollout": {"response_length": 6144, "val_kwargs": {"temperature": 0.0}},
        },
        # the policy and 14 tool schemas make a ~2.5k-token first prompt
        "data": {"max_prompt_length": 4096, "max_response_length": 6144, "train_batch_size": 16},
        "trainer": {"test_freq": 10, "save_freq": 20},
        "voltrl": {
            # one row per conversation: Agent Framework's re-rendered history extends each
            # previous prompt + response under Qwen2.5's template (see the README)
            "trajectory": {"mode": "trajectory", "agent_filter": AGENT_FILTER},
        },
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: the shared VERL options and the customer's endpoint."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verl_arguments(
        parser, model="Qwen/Qwen2.5-1.5B-Instruct", preset="1gpu-80gb", steps=100,
        name="tau2-airline-verl",
    )  # fmt: skip
    parser.add_argument("--data", type=Path, default=None, help="default: $TAU2_DATA_DIR")
    parser.add_argument("--user-endpoint", help="OpenAI-compatible URL of the customer's model")
    parser.add_argument("--user-model", help="the customer's model name")
    parser.add_argument("--user-api-key-env", default=None, help="env var with its API key")
    return parser.parse_args(argv)


def algorithm(args: argparse.Namespace) -> vl.VERL:
    """The run's VERL algorithm (composes and validates verl's config)."""
    return verl_algorithm(args, config(), max_tokens=MAX_TOKENS)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.user_endpoint and not args.user_model:
        raise SystemExit("--user-endpoint needs --user-model")
    sys.path.insert(0, str(HERE))
    from agent import AGENT_FILTER as TRAINED
    from agent import airline_episode, task_rows
    from airline_db import data_dir, load_domain

    if TRAINED != AGENT_FILTER:
        raise RuntimeError("AGENT_FILTER no longer matches agent.AGENT_FILTER")

    root = data_dir(args.data)
    domain = load_domain(root)
    resources, user = None, "scripted"
    if args.user_endpoint:
        customer = vl.LLM(
            endpoint=args.user_endpoint,
            model=args.user_model,
            api_key_env=args.user_api_key_env,
            sampling_parameters={"temperature": 0.0, "max_tokens": 256},
        )
        resources, user = {"user_llm": customer}, "user_llm"
    train = task_rows(root, domain.task_ids("train"), user)
    val = task_rows(root, domain.task_ids("test"), user)
    # the trainer's gateways front the customer only: never trained, so no token ids asked
    return verl_fit(
        args, algorithm(args), airline_episode, train, val, resources=resources,
        request_token_ids=False,
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
