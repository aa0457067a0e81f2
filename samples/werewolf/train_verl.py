"""Train one side of the werewolf game with verl on GPUs (``vl.VERL``), the other side on an
external model, as ``run.py train`` does with LocalRL.

    pip install -e '.[verl,agentscope]' 'verl[vllm]==0.9.1' -c constraints/agentscope.txt
    python samples/werewolf/train_verl.py --model Qwen/Qwen2.5-1.5B-Instruct --train village \\
        --opponent-endpoint https://api.openai.com/v1 --opponent-model gpt-4.1-mini \\
        --opponent-api-key-env OPENAI_API_KEY

Without ``--opponent-endpoint`` every seat plays the trained model and ``--train`` picks whose
calls train. Trailing ``key=value`` arguments are verl (or ``voltrl.*``) overrides; see
docs/verl.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import voltrl as vl
from voltrl.cli.verl import verl_algorithm, verl_arguments, verl_fit

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from rules import RULESETS  # noqa: E402  (framework-free: the parser needs no AgentScope)

MAX_TOKENS = 256  # per model call: a speech, or a vote as structured output


def config(train: str = "village") -> dict:
    """verl's keys for this game, plus the ``voltrl`` section."""
    sides = "wolves|village" if train == "both" else train
    return {
        "actor_rollout_ref": {
            "actor": {"optim": {"lr": 1e-6}},
            "rollout": {"response_length": MAX_TOKENS, "val_kwargs": {"temperature": 0.0}},
        },
        # the multi-agent formatter puts the game so far into each prompt (trimmed to a budget)
        "data": {"max_prompt_length": 4096, "train_batch_size": 8},
        "trainer": {"test_freq": 10, "save_freq": 20},
        "voltrl": {
            # one row per call of the trained side, each with its own penalties plus the
            # side's outcome (agent.side_filter; per-step credit, gamma 0)
            "trajectory": {
                "mode": "transition",
                "agent_filter": rf"policy/({sides})/[^/]+/[^/]+",
                # both sides: a GRPO group per side (agent.SIDE_GROUPS)
                "group_by_agent": r"[^/]+/([^/]+)/.*" if train == "both" else None,
                "credit": "per_step",
                "gamma": 0.0,
                "per_step_add_final": True,
                "max_transitions_per_rollout": 64,
            },
            "rollout_weighting": True,
        },
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: the shared VERL options, the side trained and the opponent."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verl_arguments(parser, model="Qwen/Qwen2.5-1.5B-Instruct", steps=100, name="werewolf-verl")
    parser.add_argument("--train", choices=["village", "wolves", "both"], default="village")
    parser.add_argument("--opponent-endpoint", help="OpenAI-compatible URL of the opponent")
    parser.add_argument("--opponent-model", help="the opponent's model name")
    parser.add_argument("--opponent-api-key-env", default=None, help="env var with its key")
    parser.add_argument("--rules", choices=sorted(RULESETS), default="agentscope")
    parser.add_argument("--max-rounds", type=int, default=None, help="default: the rules' cap")
    parser.add_argument(
        "--history-tokens", type=int, default=None, help="per player (default: agent.py's)"
    )
    return parser.parse_args(argv)


def algorithm(args: argparse.Namespace) -> vl.VERL:
    """The run's VERL algorithm (composes and validates verl's config)."""
    return verl_algorithm(args, config(args.train), max_tokens=MAX_TOKENS)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.opponent_endpoint and not args.opponent_model:
        raise SystemExit("--opponent-endpoint needs --opponent-model")
    from agent import SIDE_GROUPS, game_rows, side_filter, werewolf_game
    from report import print_report

    trajectory = config(args.train)["voltrl"]["trajectory"]
    if (trajectory["agent_filter"], trajectory["group_by_agent"]) != (
        side_filter(args.train),
        SIDE_GROUPS if args.train == "both" else None,
    ):
        raise RuntimeError("config()'s trajectory no longer matches agent.py's")
    if args.train == "both":
        print("warning: --train both: the published werewolf work trained one side per run, "
              "because both at once worked poorly", file=sys.stderr)  # fmt: skip
    resources, external = None, None
    if args.opponent_endpoint:
        if args.train == "both":
            raise SystemExit("--train both has no side left for the opponent")
        opponent = vl.LLM(
            endpoint=args.opponent_endpoint,
            model=args.opponent_model,
            api_key_env=args.opponent_api_key_env,
            sampling_parameters={"temperature": 0.7, "max_tokens": MAX_TOKENS},
        )
        resources = {"opponent_llm": opponent}
        external = {"side": "wolves" if args.train == "village" else "village"}
    settings = {"rules": args.rules, "max_rounds": args.max_rounds, "tokenizer": args.model,
                "history_tokens": args.history_tokens}  # fmt: skip
    rows = game_rows(2000, args.seed, train=args.train, external=external, **settings)
    val = game_rows(16, 10_000 + args.seed, train=args.train, external=external, **settings)
    return verl_fit(
        args, algorithm(args), werewolf_game, rows, val, resources=resources,
        request_token_ids=False, report=print_report,
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
