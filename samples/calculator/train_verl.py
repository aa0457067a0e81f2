"""Train the calculator agent with verl on GPUs (``vl.VERL``), the same ``agent.py`` as the demo.

    pip install 'voltrl[verl]' 'verl[vllm]==0.9.1'        # on the GPU machine(s)
    ray start --head                                        # optional on one machine
    python samples/calculator/train_verl.py --model Qwen/Qwen2.5-1.5B-Instruct --preset 1gpu-40gb
    python samples/calculator/train_verl.py --model Qwen/Qwen2.5-7B-Instruct --preset 8gpu \\
        actor_rollout_ref.actor.optim.lr=5e-7 trainer.logger='[console,wandb]'

Trailing ``key=value`` arguments are verl (or ``voltrl.*``) overrides; ``--config`` takes a
YAML file of the same keys. See docs/verl.md for GPU memory needs and every key.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import voltrl as vl

HERE = Path(__file__).resolve().parent


def config(args: argparse.Namespace) -> dict:
    """verl's keys for this agent: three model calls per task at most, short answers."""
    return {
        "actor_rollout_ref": {
            "model": {"path": args.model},
            "actor": {"optim": {"lr": 1e-6}},
            "rollout": {"response_length": 1024, "val_kwargs": {"temperature": 0.0}},
        },
        "data": {"max_prompt_length": 512},
        "trainer": {
            "total_training_steps": args.steps,
            "test_freq": 10,
            "save_freq": 50,
            "val_before_train": True,
        },
        "voltrl": {
            # one row per rollout: the tool result joins the response as context (mask 0)
            "trajectory": {"mode": "trajectory"},
            "rollout_weighting": True,
        },
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen2.5-1.5B-Instruct")
    parser.add_argument("--preset", default="1gpu-40gb", choices=["1gpu-40gb", "8gpu"])
    parser.add_argument("--config", type=Path, default=None, help="a YAML of verl keys")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--train-tasks", type=int, default=4096)
    parser.add_argument("--val-tasks", type=int, default=192)
    parser.add_argument("--runners", type=int, default=4, help="runner processes")
    parser.add_argument("--concurrency", type=int, default=32, help="rollouts per runner")
    parser.add_argument("--name", default="calculator-verl", help="run name (resumes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="key=value verl / voltrl.* overrides")
    return parser.parse_args(argv)


def algorithm(args: argparse.Namespace) -> vl.VERL:
    """The VERL algorithm of this run (composes and validates verl's config)."""
    overrides = list(args.overrides)
    source = args.config if args.config is not None else config(args)
    if args.config is not None:
        overrides = [f"actor_rollout_ref.model.path={args.model}", *overrides]
    return vl.VERL(
        source,
        overrides=overrides,
        preset=args.preset,
        sampling={"max_tokens": 256},  # per call; three calls fit rollout.response_length
        val_sampling={"max_tokens": 256},
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    sys.path.insert(0, str(HERE))
    from agent import calculator_agent
    from data import make_tasks

    trainer = vl.Trainer(
        algorithm(args),
        n_runners=args.runners,
        max_concurrency=args.concurrency,
        name=args.name,
        rollout_timeout_s=600,
    )
    train = make_tasks(args.train_tasks, seed=args.seed)
    val = make_tasks(args.val_tasks, seed=args.seed + 1)
    result = trainer.fit(calculator_agent, train, val_dataset=val)
    print(f"run directory: {result.run_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
