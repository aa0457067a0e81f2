"""Run the calc_mcp agent: ``dev`` against any OpenAI-compatible server, ``train`` with LocalRL.

python samples/calc_mcp/run.py dev --endpoint http://127.0.0.1:8000/v1 --model NAME
python samples/calc_mcp/run.py train                     # tiny random model, 2 steps, CPU
python samples/calc_mcp/run.py train --model Qwen/Qwen2.5-0.5B-Instruct --steps 30
python samples/calc_mcp/run.py train --loggers tensorboard  # also to TensorBoard

``--shared-server``: one calculator server for the run, called by every rollout over
streamable HTTP, instead of a stdio server started by each rollout.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import sample_cli as cli  # noqa: E402
from agent import calc_agent, calc_agent_at, shared_calculator  # noqa: E402
from data import make_problems  # noqa: E402

import voltrl as vl  # noqa: E402


@contextlib.contextmanager
def the_agent(args: argparse.Namespace) -> Iterator[vl.LitAgent]:
    """The agent: with the run's one calculator server (``--shared-server``), or its own."""
    if not args.shared_server:
        yield calc_agent
        return
    with shared_calculator() as url:
        print(f"calculator MCP server at {url}", flush=True)
        yield calc_agent_at(url)


def dev(args: argparse.Namespace) -> vl.RunResult:
    """Run the agent once per problem against ``--endpoint``, recording every call."""
    llm = vl.LLM(
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key,
        sampling_parameters={"temperature": 0.0, "max_tokens": args.max_tokens},
    )
    trainer = vl.Trainer(
        resources={"main_llm": llm},
        n_runners=1,
        max_concurrency=args.concurrency,
        request_token_ids=not args.no_token_ids,
        **cli.trainer_args(args),
    )
    with the_agent(args) as agent:
        return trainer.dev(agent, make_problems(args.tasks, seed=args.seed))


def train(args: argparse.Namespace) -> vl.RunResult:
    """Train the model behind the agent with LocalRL on this machine."""
    algorithm = cli.local_rl(args, trajectory=None)  # a row per call
    trainer = vl.Trainer(
        algorithm,
        n_runners=1,
        max_concurrency=args.concurrency,
        rollout_timeout_s=600,
        **cli.trainer_args(args),
    )
    problems = make_problems(args.train_tasks + args.val_tasks, seed=args.seed)
    with the_agent(args) as agent:
        return trainer.fit(agent, problems[args.val_tasks :], problems[: args.val_tasks])


def main(argv: list[str] | None = None) -> int:
    parser, sub = cli.sample_parser(__doc__)
    common = argparse.ArgumentParser(add_help=False, parents=[cli.trainer_options()])
    common.add_argument("--seed", type=int, default=0, help="problem generation seed")
    common.add_argument("--concurrency", type=int, default=4, help="rollouts in flight")
    common.add_argument(
        "--shared-server",
        action="store_true",
        help="one calculator MCP server for the run (HTTP), not one per rollout (stdio)",
    )

    d = cli.subcommand(sub, "dev", "run against an OpenAI-compatible server", [common])
    d.add_argument("--endpoint", required=True, help="base URL, e.g. http://127.0.0.1:8000/v1")
    d.add_argument("--model", required=True, help="model name the endpoint serves")
    d.add_argument("--api-key", default="EMPTY", help="the endpoint's API key")
    d.add_argument("--tasks", type=int, default=8, help="problems to run")
    d.add_argument("--max-tokens", type=int, default=512, help="per model call")
    d.add_argument(
        "--no-token-ids", action="store_true", help="for hosted APIs that reject vLLM's fields"
    )
    d.set_defaults(run=dev)

    t = cli.subcommand(sub, "train", "train with LocalRL on this machine", [common])
    t.add_argument("--model", default=None, help="path or hub name (default: the tiny model)")
    cli.add_resume(t)
    t.add_argument("--steps", type=int, default=2, help="policy updates")
    t.add_argument("--tasks-per-step", type=int, default=2, help="problems per update")
    t.add_argument("--group-size", type=int, default=4, help="rollouts per problem")
    t.add_argument("--train-tasks", type=int, default=200, help="training problems")
    t.add_argument("--val-tasks", type=int, default=4, help="held-out problems")
    t.add_argument("--max-tokens", type=int, default=48, help="per model call")
    t.set_defaults(run=train)
    return cli.main_with(parser, argv, cli.run_command)


if __name__ == "__main__":
    sys.exit(main())
