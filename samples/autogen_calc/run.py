"""Run the AutoGen calculator agent: ``dev`` against any OpenAI-compatible endpoint, or
``train`` it with LocalRL on this machine.

    python samples/autogen_calc/run.py dev --endpoint http://127.0.0.1:8000/v1 --model NAME
    python samples/autogen_calc/run.py train                  # the tiny built-in model, 2 steps
    python samples/autogen_calc/run.py train --model Qwen/Qwen2.5-0.5B-Instruct --steps 50
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from agent import autogen_calc_agent  # noqa: E402
from data import make_problems, write_jsonl  # noqa: E402

import voltrl as vl  # noqa: E402


def datasets(seed: int, n_train: int, n_val: int) -> tuple[list[dict], list[dict]]:
    """Training and held-out problems from ``seed``, no question in both."""
    val = make_problems(n_val, seed=10_000 + seed)
    held_out = {row["question"] for row in val}
    train = [r for r in make_problems(n_train, seed=seed) if r["question"] not in held_out]
    return train, val


def dev(args: argparse.Namespace) -> vl.RunResult:
    """Run the agent once per problem against ``--endpoint``, no training."""
    _, problems = datasets(args.seed, 0, args.n)
    write_jsonl(problems, args.out / "autogen_calc-dev" / "problems.jsonl")
    sampling = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    llm = vl.LLM(
        endpoint=args.endpoint, model=args.model, api_key=args.api_key, sampling_parameters=sampling
    )
    trainer = vl.Trainer(
        n_runners=1,
        max_concurrency=args.concurrency,
        resources={"main_llm": llm},
        run_dir=args.out,
        name="autogen_calc-dev",
        request_token_ids=not args.no_token_ids,
    )
    result = trainer.dev(autogen_calc_agent, problems)
    solved = result.stats.reward_mean or 0.0
    print(f"solved {solved:.1%} of {len(problems)} problems; run in {result.run_dir}")
    return result


def local_model(name: str | None, seed: int) -> dict[str, Any]:
    """``LocalRL``'s ``model`` (and ``tokenizer``): a path or hub name, else the tiny model."""
    if name:
        return {"model": name}
    from voltrl.algorithms.local.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    return {"model": build_tiny_model(tokenizer, hidden=128, seed=seed), "tokenizer": tokenizer}


def train(args: argparse.Namespace) -> vl.RunResult:
    """Train the agent's model with LocalRL, validating before and after."""
    from voltrl.trajectory import TrajectoryConfig

    train_rows, val_rows = datasets(args.seed, 500, args.n_val)
    sampling = {"temperature": 1.0, "max_tokens": args.max_tokens}
    algorithm = vl.LocalRL(
        **local_model(args.model, args.seed),
        steps=args.steps,
        tasks_per_step=args.tasks_per_step,
        group_size=args.group_size,
        sampling=sampling,
        val_sampling={**sampling, "temperature": 0.0},
        val_every=args.steps,
        trajectory=TrajectoryConfig(mode="trajectory"),
        seed=args.seed,
    )
    trainer = vl.Trainer(
        algorithm,
        n_runners=1,
        max_concurrency=args.concurrency,
        run_dir=args.out,
        name="autogen_calc-train",
    )
    result = trainer.fit(autogen_calc_agent, train_rows, val_rows)
    val = [h["val/reward_mean"] for h in algorithm.history if "val/reward_mean" in h]
    if val:
        print(f"held-out reward: {val[0]:.1%} before, {val[-1]:.1%} after; run in {result.run_dir}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--seed", type=int, default=0, help="problem generation seed")
    common.add_argument("--out", type=Path, default=Path("runs"), help="run directory root")
    common.add_argument("--concurrency", type=int, default=8, help="rollouts at a time")

    d = sub.add_parser("dev", parents=[common], help="run the agent against an endpoint")
    d.add_argument("--endpoint", required=True, help="OpenAI-compatible base URL (.../v1)")
    d.add_argument("--model", required=True, help="model name the endpoint serves")
    d.add_argument("--api-key", default="EMPTY")
    d.add_argument("--n", type=int, default=16, help="problems to run")
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--max-tokens", type=int, default=512)
    d.add_argument(
        "--no-token-ids",
        action="store_true",
        help="do not ask the endpoint for token ids (hosted APIs that reject the field)",
    )
    d.set_defaults(run=dev)

    t = sub.add_parser("train", parents=[common], help="train with LocalRL on this machine")
    t.add_argument("--model", help="model path or hub name (default: the tiny random model)")
    t.add_argument("--steps", type=int, default=2, help="policy updates")
    t.add_argument("--tasks-per-step", type=int, default=4)
    t.add_argument("--group-size", type=int, default=4)
    t.add_argument("--n-val", type=int, default=8, help="held-out problems")
    t.add_argument("--max-tokens", type=int, default=64)
    t.set_defaults(run=train)

    args = parser.parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
