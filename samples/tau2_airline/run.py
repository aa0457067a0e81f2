"""The tau2-style airline assistant: make a domain, run it against endpoints, or train it.

    python samples/tau2_airline/run.py generate --out tau2-data        # our generated domain
    python samples/tau2_airline/run.py dev --endpoint URL --model NAME \\
        [--user-endpoint URL --user-model NAME]                         # default: scripted user
    python samples/tau2_airline/run.py train [--name N [--resume]]      # LocalRL, tiny model
    python samples/tau2_airline/run.py train --loggers tensorboard      # also to TensorBoard

The data is ``--data DIR``, else ``$TAU2_DATA_DIR`` (tau2-bench's data directory, or one
written by ``generate``); with neither, the generated domain of seed 0 is written under
``--run-dir`` and used. After each run, a table of how the episodes ended.
``voltrl train runs/<name>/train.yaml`` runs a ``train`` again.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import sample_cli as cli  # noqa: E402
from agent import AGENT_FILTER, MAX_TURNS, airline_episode, task_rows  # noqa: E402
from airline_db import DomainDataError, load_domain, write_domain  # noqa: E402
from generate_domain import make_domain  # noqa: E402

import voltrl as vl  # noqa: E402
from voltrl.cli.endpoints import check_llm  # noqa: E402
from voltrl.store import open_store  # noqa: E402


def resolve_data(args: argparse.Namespace) -> Path:
    """``--data``, else ``$TAU2_DATA_DIR``, else the generated domain under ``--run-dir``."""
    if args.data:
        return Path(args.data)
    if os.environ.get("TAU2_DATA_DIR"):
        return Path(os.environ["TAU2_DATA_DIR"])
    target = args.run_dir / "tau2-generated"
    if not (target / "tau2").exists():
        write_domain(make_domain(0), target)
        print(f"no --data or TAU2_DATA_DIR: wrote the generated domain (seed 0) to {target}")
    return target


def user_llm(args: argparse.Namespace) -> vl.LLM | None:
    """The customer's LLM when ``--user-endpoint`` is given (any OpenAI-compatible server;
    never trained)."""
    if not args.user_endpoint:
        return None
    return vl.LLM(
        endpoint=args.user_endpoint,
        model=args.user_model,
        api_key_env=args.user_api_key_env,
        sampling_parameters={"temperature": 0.0, "max_tokens": 256},
    )


async def episode_report(store_path: Path, rollouts: list) -> dict[str, Counter]:
    """How these rollouts' episodes ended, by mode: ``{mode: Counter(termination)}``
    (``failed``: the rollout raised)."""
    store = open_store(store_path)
    try:
        out: dict[str, Counter] = {}
        for rollout in rollouts:
            ends = [
                s.attributes.get("termination")
                for s in await store.get_spans(rollout.rollout_id, rollout.final_attempt_id)
                if s.name == "episode"
            ]
            out.setdefault(rollout.mode, Counter())[ends[-1] if ends else rollout.status] += 1
        return out
    finally:
        await store.close()


def print_report(result: vl.RunResult) -> None:
    """Print how the episodes ended."""
    report = asyncio.run(episode_report(result.run_dir / "store.sqlite", result.rollouts))
    for mode, ends in sorted(report.items()):
        print(f"{mode} episodes: " + ", ".join(f"{k} {v}" for k, v in ends.most_common()))


def dev(args: argparse.Namespace) -> vl.RunResult:
    """Each task of ``--split`` once: assistant on ``--endpoint``, customer scripted or on
    ``--user-endpoint``."""
    data = resolve_data(args)
    ids = load_domain(data).task_ids(args.split)[: args.limit]
    llm = vl.LLM(
        endpoint=args.endpoint,
        model=args.model,
        api_key_env=args.api_key_env,
        sampling_parameters={"temperature": args.temperature, "max_tokens": args.max_tokens},
    )
    check_llm(llm, "the assistant's endpoint")
    resources = {"main_llm": llm}
    if (customer := user_llm(args)) is not None:
        check_llm(customer, "the customer's endpoint")
        resources["user_llm"] = customer
    trainer = vl.Trainer(
        resources=resources,
        n_runners=1,
        max_concurrency=args.concurrency,
        request_token_ids=not args.no_token_ids,
        rollout_timeout_s=900,
        **cli.trainer_args(args),
    )
    user = "user_llm" if customer is not None else "scripted"
    return trainer.dev(airline_episode, task_rows(data, ids, user))


def train(args: argparse.Namespace) -> vl.RunResult:
    """LocalRL on ``--model`` (default: the tiny random model): the assistant's calls only."""
    from voltrl.algorithms.local.update import PolicyUpdateConfig
    from voltrl.trajectory import TrajectoryConfig

    data = resolve_data(args)
    domain = load_domain(data)
    customer = user_llm(args)
    if customer is not None:
        check_llm(customer, "the customer's endpoint")
    # who plays the customer: user_llm (--user-endpoint), the model itself, or the script
    user = "scripted" if args.user != "policy" else "main_llm"
    if customer is not None:
        user = "user_llm"
    algorithm = vl.LocalRL(
        args.model or "tiny",
        steps=args.steps,
        tasks_per_step=args.tasks_per_step,
        group_size=args.group_size,
        sampling={"temperature": 1.0, "max_tokens": args.max_tokens},
        val_sampling={"temperature": 0.0, "max_tokens": args.max_tokens},
        val_every=args.steps,
        update=PolicyUpdateConfig(lr=args.lr, seed=args.seed),
        trajectory=TrajectoryConfig(
            mode="trajectory",
            agent_filter=AGENT_FILTER,
            max_prompt_length=args.max_prompt_length,
            length_policy="drop",
        ),
        seed=args.seed,
        resume=args.resume,
    )
    trainer = vl.Trainer(
        algorithm,
        n_runners=1,
        max_concurrency=args.concurrency,
        rollout_timeout_s=900,
        resources={"user_llm": customer} if customer is not None else None,
        request_token_ids=False,  # the trainer's gateways front the customer only
        **cli.trainer_args(args),
    )
    train_rows = task_rows(data, domain.task_ids("train"), user)
    val_rows = task_rows(data, domain.task_ids("test")[: args.n_val], user)
    result = trainer.fit(airline_episode, train_rows, val_rows)
    for record in algorithm.history:
        if "batch/rows" in record:
            print(
                f"step {record['step']}: {record['batch/rows']} assistant rows "
                f"({record.get('batch/merge_failures', 0)} merge failures), "
                f"{record.get('batch/dropped/agent_filter', 0)} user calls left out, "
                f"{record.get('batch/dropped/too_long', 0)} rows too long"
            )
    return result


def main(argv: list[str] | None = None) -> int:
    parser, sub = cli.sample_parser(__doc__)
    common = argparse.ArgumentParser(add_help=False, parents=[cli.trainer_options()])
    common.add_argument("--data", type=Path, help="tau2 data directory (default $TAU2_DATA_DIR)")
    common.add_argument("--concurrency", type=int, default=4, help="episodes at a time")
    common.add_argument("--user-endpoint", help="OpenAI-compatible URL of the customer's model")
    common.add_argument("--user-model", help="the customer's model name")
    common.add_argument("--user-api-key-env", default=None, help="env var with its API key")

    g = cli.subcommand(sub, "generate", "write the generated domain in tau2's format")
    g.add_argument("--out", type=Path, required=True, help="the data directory to write")
    g.add_argument("--seed", type=int, default=0, help="the domain's seed")

    d = cli.subcommand(sub, "dev", "run each task once against endpoints", [common])
    d.add_argument("--endpoint", required=True, help="the assistant's OpenAI-compatible URL")
    d.add_argument("--model", required=True, help="the assistant's model name")
    d.add_argument("--api-key-env", default=None, help="env var with the assistant's API key")
    d.add_argument("--split", default="test", help="train, test or all")
    d.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    d.add_argument("--temperature", type=float, default=0.0, help="the assistant's sampling")
    d.add_argument("--max-tokens", type=int, default=512, help="per assistant call")
    d.add_argument("--no-token-ids", action="store_true", help="for hosted APIs")

    t = cli.subcommand(sub, "train", "train the assistant with LocalRL", [common])
    t.add_argument("--model", default=None, help="path or hub name (default: the tiny model)")
    t.add_argument(
        "--user",
        choices=["scripted", "policy"],
        default=None,
        help="who plays the customer without --user-endpoint: the script (default), or the "
        "model being trained (its calls are left out of training)",
    )
    cli.add_resume(t)
    t.add_argument("--steps", type=int, default=2, help="policy updates")
    t.add_argument("--tasks-per-step", type=int, default=2, help="tasks per update")
    t.add_argument("--group-size", type=int, default=4, help="episodes per task")
    t.add_argument("--n-val", type=int, default=4, help="held-out tasks to validate on")
    t.add_argument("--max-tokens", type=int, default=64, help="per assistant call")
    t.add_argument("--max-prompt-length", type=int, default=3500, help="longer rows are dropped")
    t.add_argument("--lr", type=float, default=1e-4, help="learning rate")
    t.add_argument("--seed", type=int, default=0, help="sampling and update seed")

    return cli.main_with(parser, argv, run, errors=(DomainDataError,), check=check_options)


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The customer's options go together: a usage error otherwise."""
    if getattr(args, "user_endpoint", None) and not args.user_model:
        parser.error("--user-endpoint needs --user-model")
    if getattr(args, "user", None) and getattr(args, "user_endpoint", None):
        parser.error("--user-endpoint plays the customer: leave out --user")


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; returns the exit status."""
    if args.command == "generate":
        write_domain(make_domain(args.seed), args.out)
        domain = load_domain(args.out)
        sizes = {k: len(v) for k, v in domain.split.items()}
        print(f"wrote {len(domain.tasks)} tasks ({sizes}) to {args.out}")
        print(f"use it: export TAU2_DATA_DIR={args.out.resolve()}")
        return 0
    result = dev(args) if args.command == "dev" else train(args)
    print_report(result)
    print(f"at most {MAX_TURNS} assistant turns per episode; run in {result.run_dir}")
    return 0 if result.stats.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
