"""Run the SQL agent (``dev``) against any OpenAI-compatible endpoint, or train it (``train``)
with LocalRL on this machine, optimising only its ``write`` and ``rewrite`` agents.

    python samples/sql_agent/run.py dev --endpoint http://127.0.0.1:8000/v1 --model NAME
    python samples/sql_agent/run.py train                   # tiny random model, 2 steps
    python samples/sql_agent/run.py train --model Qwen/Qwen2.5-0.5B-Instruct --steps 20
    python samples/sql_agent/run.py train --loggers tensorboard  # also to TensorBoard
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import sample_cli as cli  # noqa: E402


def load_agent_module() -> Any:
    """``agent.py`` of this sample, imported by path under a name of its own."""
    name = "voltrl_sample_sql_agent"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / "agent.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def questions(split: str) -> list[dict[str, Any]]:
    """The sample's questions of one split (``train``, ``val`` or ``all``)."""
    rows = [json.loads(line) for line in (HERE / "questions.jsonl").read_text().splitlines()]
    return [r for r in rows if split == "all" or r["split"] == split]


def dev(args: argparse.Namespace) -> int:
    """Run each question once against the endpoint; the reward table is printed at the end."""
    import voltrl as vl

    llm = vl.LLM(
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key,
        sampling_parameters={"temperature": args.temperature, "max_tokens": args.max_tokens},
    )
    trainer = vl.Trainer(
        resources={"main_llm": llm},
        n_runners=1,
        inline=True,
        max_concurrency=args.concurrency,
        request_token_ids=not args.no_token_ids,
        rollout_timeout_s=300,
        **cli.trainer_args(args),
    )
    rows = questions(args.split)[: args.limit]
    result = trainer.dev(load_agent_module().sql_agent, rows)
    return 0 if result.stats.failed == 0 else 1


def train(args: argparse.Namespace) -> int:
    """Train with LocalRL; only the calls of ``write`` and ``rewrite`` become training rows."""
    import voltrl as vl
    from voltrl.algorithms.local.update import PolicyUpdateConfig
    from voltrl.trajectory import TrajectoryConfig

    agent = load_agent_module()
    algorithm = cli.local_rl(
        args,
        update=PolicyUpdateConfig(lr=args.lr, seed=args.seed),
        trajectory=TrajectoryConfig(agent_filter=agent.AGENT_FILTER),
    )
    trainer = vl.Trainer(
        algorithm,
        n_runners=1,
        inline=True,
        max_concurrency=args.tasks_per_step * args.group_size,
        rollout_timeout_s=600,
        **cli.trainer_args(args),
    )
    val = questions("val")[: args.val_limit]
    result = trainer.fit(agent.sql_agent, questions("train"), val)
    for record in algorithm.history:
        if "batch/rows" in record:
            print(
                f"step {record['step']}: trained on {record['batch/rows']} write/rewrite calls, "
                f"left out {record.get('batch/dropped/agent_filter', 0)} check calls"
            )
    print(f"final model: {result.run_dir / 'final'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser, sub = cli.sample_parser(__doc__)
    options = cli.trainer_options()
    run_dev = cli.subcommand(sub, "dev", "run each question once against an endpoint", [options])
    run_dev.add_argument("--endpoint", required=True, help="OpenAI-compatible base URL (…/v1)")
    run_dev.add_argument("--model", required=True, help="model name the endpoint serves")
    run_dev.add_argument("--api-key", default="EMPTY", help="the endpoint's API key")
    run_dev.add_argument(
        "--split", choices=["train", "val", "all"], default="val", help="questions to run"
    )
    run_dev.add_argument("--limit", type=int, default=None, help="only the first N questions")
    run_dev.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    run_dev.add_argument("--max-tokens", type=int, default=256, help="per model call")
    run_dev.add_argument("--concurrency", type=int, default=4, help="questions at a time")
    run_dev.add_argument(
        "--no-token-ids", action="store_true", help="the endpoint is a hosted API (no vLLM ids)"
    )
    run_dev.set_defaults(fn=dev)

    run_train = cli.subcommand(sub, "train", "train write/rewrite with LocalRL", [options])
    run_train.add_argument(
        "--model", default=None, help="model path or hub name (default: a tiny random model)"
    )
    cli.add_resume(run_train)
    run_train.add_argument("--steps", type=int, default=2, help="policy updates")
    run_train.add_argument("--tasks-per-step", type=int, default=2, help="questions per update")
    run_train.add_argument("--group-size", type=int, default=2, help="rollouts per question")
    run_train.add_argument("--max-tokens", type=int, default=48, help="per model call")
    run_train.add_argument("--val-limit", type=int, default=2, help="validation questions")
    run_train.add_argument("--lr", type=float, default=1e-5, help="learning rate")
    run_train.add_argument("--seed", type=int, default=0, help="sampling and update seed")
    run_train.set_defaults(fn=train)
    return cli.main_with(parser, argv, lambda args: args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
