"""Werewolf on AgentScope: play games against endpoints (dev) or train a side (train).

Every run ends with a report of the games (winners, calls and tokens per game, invalid
answers, refused prompts); ``train`` can train one side or both with LocalRL.

    python samples/werewolf/run.py dev --endpoint URL --model NAME [--games 4]
    python samples/werewolf/run.py dev --teacher --games 100       # every seat on teacher.py
    python samples/werewolf/run.py train [--name N [--resume]]   # tiny model, village trained
    python samples/werewolf/run.py train --loggers tensorboard   # also to TensorBoard
    python samples/werewolf/run.py train --train wolves \\
        --opponent-endpoint URL --opponent-model NAME             # the village on another model
    python samples/werewolf/run.py train --train wolves --opponent-teacher \\
        --warm-start runs/teacher                                 # warmed up, vs the teacher

``voltrl train runs/<name>/train.yaml`` runs a ``train`` again (not one whose opponent was
``--opponent-teacher``: that server ends with the run). The learning recipe (the teacher's
games, the warm start, RL, the win rates before and after) is ``recipe.py``:
``benchmarks/learning.py werewolf --side wolves``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import sample_cli as cli  # noqa: E402
from agent import (  # noqa: E402
    CHOICE_REWARD,
    INVALID_PENALTY,
    SIDE_GROUPS,
    game_rows,
    reward_errors,
    side_filter,
    werewolf_game,
)
from memory import HISTORY_TOKENS  # noqa: E402
from report import print_report  # noqa: E402
from rules import RULESETS  # noqa: E402

import voltrl as vl  # noqa: E402
from voltrl.cli.endpoints import check_llm  # noqa: E402

RECIPE_HINT = (
    "The learning recipe (the scripted teacher's games, a warm start on them, RL against the "
    "teacher, the win rates before and after with 95% intervals; its settings are its own, "
    "not these options' defaults): .venv-agentscope/bin/python benchmarks/learning.py "
    "werewolf --side wolves|village [--model smollm2-135m-instruct] [--seeds 0 1 2], about "
    "40 minutes a seed of the tiny student on 2 CPU cores; results in runs/learning/, the run "
    "in runs/werewolf-<side>-recipe-seed<N>/. See samples/werewolf/README.md."
)


def opponent(args: argparse.Namespace) -> vl.LLM | None:
    """The external players' model (``--opponent-endpoint``): any OpenAI-compatible server;
    its calls are recorded, never trained."""
    if not args.opponent_endpoint:
        return None
    return vl.LLM(
        endpoint=args.opponent_endpoint,
        model=args.opponent_model,
        api_key_env=args.opponent_api_key_env,
        sampling_parameters={"temperature": 0.7, "max_tokens": args.max_tokens},
    )


def external_of(args: argparse.Namespace, train: str) -> dict | None:
    """Who the opponent model (or ``--opponent-teacher``) plays: the side not trained
    (``dev``: the wolves), or ``--external-fraction`` of the seats."""
    if not (args.opponent_endpoint or getattr(args, "opponent_teacher", False)):
        return None
    if args.external_fraction is not None:
        return {"fraction": args.external_fraction}
    return {"side": "wolves" if train == "village" else "village"}


def dev(args: argparse.Namespace) -> vl.RunResult:
    """``--games`` games against ``--endpoint`` (and ``--opponent-endpoint``), or with
    ``--teacher`` against the scripted teacher (``teacher.py``) served on loopback."""
    with contextlib.ExitStack() as stack:
        endpoint, model, token_ids = args.endpoint, args.model, not args.no_token_ids
        if args.teacher:
            from teacher import policy

            from voltrl.serving.teacher import serve_teacher

            endpoint = stack.enter_context(serve_teacher(policy, seed=args.seed))
            model, token_ids = "teacher", False  # it answers like a hosted API: no token ids
        resources = {
            "main_llm": vl.LLM(
                endpoint=endpoint,
                model=model,
                api_key_env=args.api_key_env,
                sampling_parameters={
                    "temperature": args.temperature,
                    "max_tokens": args.max_tokens,
                },
            )
        }
        check_llm(resources["main_llm"], "the players' endpoint")
        if (other := opponent(args)) is not None:
            check_llm(other, "the opponent's endpoint")
            resources["opponent_llm"] = other
        trainer = vl.Trainer(
            resources=resources,
            n_runners=1,
            max_concurrency=args.concurrency,
            request_token_ids=token_ids,
            rollout_timeout_s=3600,
            **cli.trainer_args(args),
        )
        rows = game_rows(
            args.games, args.seed, external=external_of(args, "village"), **game_settings(args)
        )
        return trainer.dev(werewolf_game, rows)


def game_settings(args: argparse.Namespace) -> dict:
    """The rows' game settings: the rule set, its round cap unless ``--max-rounds`` gives
    one, each player's history budget in tokens of ``--tokenizer`` (``train``: the trained
    model's), the invalid-answer penalty and the reward of a choice against the other side."""
    settings = {
        "rules": args.rules,
        "history_tokens": args.history_tokens,
        "invalid_penalty": args.invalid_penalty,
        "choice_reward": args.choice_reward,
    }
    if args.max_rounds is not None:
        settings["max_rounds"] = args.max_rounds
    if tokenizer := args.tokenizer or (args.model or "tiny" if args.run is train else None):
        settings["tokenizer"] = tokenizer
    return settings


def train(args: argparse.Namespace) -> vl.RunResult:
    """LocalRL on ``--model`` (default: the tiny model), training ``--train``'s calls; the
    opponent's side on ``--opponent-endpoint`` or on the scripted teacher
    (``--opponent-teacher``), the model first warmed up on a teacher run (``--warm-start``)."""
    with contextlib.ExitStack() as stack:
        other = opponent(args)
        if args.opponent_teacher:
            from teacher import policy

            from voltrl.serving.teacher import serve_teacher

            url = stack.enter_context(serve_teacher(policy, seed=args.seed))
            other = vl.LLM(endpoint=url, model="teacher")
        elif other is not None:
            check_llm(other, "the opponent's endpoint")
        return train_against(args, other)


def warm_start(args: argparse.Namespace) -> vl.SFT | None:
    """``--warm-start``: SFT on the ``--train`` side's calls of those runs (the teacher's, from
    ``dev --teacher``), one row per call, re-tokenised with the student's chat template."""
    if not args.warm_start:
        return None
    return vl.SFT(
        source=args.warm_start,
        agents=side_filter(args.train),
        retokenize=True,  # the teacher answers like a hosted API: no token ids
        trajectory={"mode": "transition"},
        steps=args.sft_steps,
        batch_size=16,
        lr=args.sft_lr,
        seed=args.seed,
    )


def train_against(args: argparse.Namespace, other: vl.LLM | None) -> vl.RunResult:
    """``train`` with the opponent's model ``other`` (None: every seat on the trained one)."""
    from voltrl.algorithms.local.update import PolicyUpdateConfig
    from voltrl.trajectory import TrajectoryConfig

    if args.train == "both":
        print(
            "warning: --train both trains the werewolves and the village on one model. The "
            "published werewolf work trained one side per run, because training both at once "
            "worked poorly; each side's calls here form GRPO groups of their own.",
            file=sys.stderr,
        )
    trajectory = TrajectoryConfig(
        mode="transition",  # the multi-agent formatter re-renders the history every call
        agent_filter=side_filter(args.train),
        group_by_agent=SIDE_GROUPS if args.train == "both" else None,  # a group per side
        credit="per_step",  # each call: its own penalty or choice reward, plus its side's outcome
        gamma=0.0,
        per_step_add_final=True,
        max_transitions_per_rollout=args.max_calls,
        max_prompt_length=args.max_prompt_length,
        length_policy="drop",
    )
    algorithm = cli.local_rl(
        args,
        args.games_per_step,
        update=PolicyUpdateConfig(lr=args.lr, seed=args.seed),
        trajectory=trajectory,
        warm_start=warm_start(args),
    )
    trainer = vl.Trainer(
        algorithm,
        n_runners=1,
        max_concurrency=args.concurrency,
        rollout_timeout_s=3600,
        resources={"opponent_llm": other} if other is not None else None,
        request_token_ids=False,  # the trainer's gateways front the opponent only
        **cli.trainer_args(args),
    )
    external = external_of(args, args.train)
    settings = game_settings(args)
    rows = game_rows(200, args.seed, train=args.train, external=external, **settings)
    val = game_rows(args.n_val, 10_000 + args.seed, train=args.train, external=external, **settings)
    result = trainer.fit(werewolf_game, rows, val)
    for record in algorithm.history:
        if "batch/rows" in record:
            print(
                f"step {record['step']}: {record['batch/rows']} trained calls in "
                f"{record.get('batch/groups', '?')} GRPO group(s); left out "
                f"{record.get('batch/dropped/agent_filter', 0)} of other players, "
                f"{record.get('batch/dropped/over_cap', 0)} over the cap of {args.max_calls}, "
                f"{record.get('batch/dropped/too_long', 0)} too long; "
                f"{record.get('batch/dropped/no_trainable_calls', 0)} games with no trained call"
            )
    return result


def main(argv: list[str] | None = None) -> int:
    parser, sub = cli.sample_parser(__doc__)
    common = argparse.ArgumentParser(add_help=False, parents=[cli.trainer_options()])
    common.add_argument("--seed", type=int, default=0, help="deals' seed")
    common.add_argument("--concurrency", type=int, default=4, help="games at a time")
    common.add_argument(
        "--rules", choices=sorted(RULESETS), default="agentscope",
        help="agentscope: AgentScope's own game; short: 4 rounds, for tiny models and tests",
    )  # fmt: skip
    common.add_argument(
        "--max-rounds", type=int, default=None,
        help="nights and days, then a draw (default: the rules' cap, 30 or 4)",
    )  # fmt: skip
    common.add_argument(
        "--history-tokens", type=int, default=HISTORY_TOKENS,
        help="each player's history budget, in tokens (its pinned note is outside it)",
    )  # fmt: skip
    common.add_argument(
        "--tokenizer", default=None,
        help="the model whose tokenizer counts the budget: tiny, a packaged model, a directory "
        "(default: train, the trained model's; dev, about 4 characters a token)",
    )  # fmt: skip
    common.add_argument("--max-tokens", type=int, default=64, help="per model call")
    common.add_argument(
        "--invalid-penalty", type=float, default=INVALID_PENALTY,
        help="the reward of a call whose answer is not a legal choice (at most 0)",
    )  # fmt: skip
    common.add_argument(
        "--choice-reward", type=float, default=CHOICE_REWARD,
        help="the reward of a call that votes out, bites, poisons or shoots a player of the "
        "other side (at least 0; 0: none, the game's outcome alone)",
    )  # fmt: skip
    common.add_argument("--opponent-endpoint", help="OpenAI-compatible URL of the opponent")
    common.add_argument("--opponent-model", help="the opponent's model name")
    common.add_argument("--opponent-api-key-env", default=None, help="env var with its key")
    common.add_argument(
        "--external-fraction", type=float, default=None,
        help="share of the seats the opponent plays, at random (default: the side not trained; "
        "in dev, the wolves)",
    )  # fmt: skip

    d = cli.subcommand(sub, "dev", "play games against endpoints", [common])
    d.add_argument("--endpoint", help="OpenAI-compatible base URL (.../v1)")
    d.add_argument("--model", help="model name the endpoint serves")
    d.add_argument(
        "--teacher", action="store_true",
        help="instead of --endpoint: the scripted teacher (teacher.py), served on loopback",
    )  # fmt: skip
    d.add_argument("--api-key-env", default=None, help="env var with the endpoint's key")
    d.add_argument("--games", type=int, default=2, help="games to play")
    d.add_argument("--temperature", type=float, default=0.7, help="the players' sampling")
    d.add_argument("--no-token-ids", action="store_true", help="for hosted APIs")
    d.epilog = (
        "With --teacher the scripted teacher plays every seat: its games warm a student up "
        "(train --warm-start RUN_DIR). " + RECIPE_HINT
    )
    d.set_defaults(run=dev)

    t = cli.subcommand(sub, "train", "train one side, or both, with LocalRL", [common])
    t.epilog = RECIPE_HINT
    cli.add_resume(t)
    t.add_argument("--model", default=None, help="path or hub name (default: the tiny model)")
    t.add_argument(
        "--train", choices=["village", "wolves", "both"], default="village", help="side trained"
    )
    t.add_argument("--steps", type=int, default=1, help="policy updates")
    t.add_argument("--games-per-step", type=int, default=1, help="deals per update")
    t.add_argument("--group-size", type=int, default=2, help="games per deal")
    t.add_argument("--n-val", type=int, default=1, help="held-out games before and after")
    t.add_argument("--max-calls", type=int, default=64, help="trained calls kept per game")
    t.add_argument("--max-prompt-length", type=int, default=4000, help="longer calls dropped")
    t.add_argument("--lr", type=float, default=1e-5, help="learning rate")
    t.add_argument(
        "--opponent-teacher", action="store_true",
        help="the side not trained on the scripted teacher (teacher.py), served on loopback, "
        "instead of --opponent-endpoint",
    )  # fmt: skip
    t.add_argument(
        "--warm-start", metavar="RUN_DIR", nargs="+", default=None,
        help="first SFT on the trained side's calls of these runs (e.g. of dev --teacher)",
    )  # fmt: skip
    t.add_argument("--sft-steps", type=int, default=200, help="--warm-start's steps of 16 calls")
    t.add_argument("--sft-lr", type=float, default=1e-4, help="--warm-start's learning rate")
    t.set_defaults(run=train)
    return cli.main_with(parser, argv, run, check=check_options)


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``dev``'s players are on ``--endpoint`` and ``--model`` or on ``--teacher``, the
    opponent's options go together, the game's numbers are positive and its penalty is not: a
    usage error otherwise."""
    for option in ("max_rounds", "history_tokens"):
        if (value := getattr(args, option)) is not None and value < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1 (got {value})")
    for wrong in reward_errors(args.invalid_penalty, args.choice_reward):
        parser.error(f"--{wrong.replace('_', '-')}")
    if args.run is dev and args.teacher and (args.endpoint or args.model):
        parser.error("--teacher plays instead of --endpoint and --model: give one or the other")
    if args.run is dev and not args.teacher and not (args.endpoint and args.model):
        parser.error("dev needs --endpoint and --model (or --teacher)")
    if bool(args.opponent_endpoint) != bool(args.opponent_model):
        parser.error("--opponent-endpoint and --opponent-model go together")
    if getattr(args, "opponent_teacher", False) and args.opponent_endpoint:
        parser.error("--opponent-teacher plays instead of --opponent-endpoint: give one")
    has_opponent = bool(args.opponent_endpoint or getattr(args, "opponent_teacher", False))
    if args.external_fraction is not None and not has_opponent:
        parser.error("--external-fraction needs an opponent (--opponent-endpoint)")
    train_both = getattr(args, "train", None) == "both"
    if train_both and has_opponent and args.external_fraction is None:
        parser.error("--train both leaves no side to the opponent: give --external-fraction")


def run(args: argparse.Namespace) -> int:
    """Run the parsed command and print the games' report; returns the exit status."""
    result = args.run(args)
    print_report(result)
    return 0 if result.stats.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
