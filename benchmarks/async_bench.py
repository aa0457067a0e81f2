"""Asynchronous LocalRL: wall-clock per trained sample and held-out reward, ``max_staleness``
0 (synchronous), 1 and 2, on the calculator agent of ``make demo``.

Each seed warms the tiny model up once (as ``make demo`` does, cached under ``<out>/.cache``),
then trains it with LocalRL three times from the same weights, the same tasks and the same
number of steps (so the same number of trained rollouts), changing only ``max_staleness``
(the runners take up to three steps' rollouts at once in every setting).
The environment's latency, each wait a heavy-tailed time between 0.2 and 2 s (``0.2 +
lognormal(-1, 0.9)``, capped: median about 0.6 s), as a web search, a database, code execution
or a simulated user takes:

- ``--latency per-call`` (the default): every model call first waits for the environment's
  turn (the tool's result, the user's reply): one to three waits per rollout;
- ``--latency per-rollout``: one wait, before the rollout's first call;
- ``--latency none``: the demo as it is (a rollout is only decoding).

It prints, per setting: training seconds (from the first validation to the last update), seconds
per trained rollout, its ratio to ``max_staleness=0`` in the same seed, held-out reward before
and after, and the gain per training minute; then the medians over seeds, and writes them to
``<out>/async-bench/<latency>.json``.

    python benchmarks/async_bench.py --seeds 0 1 2
    python benchmarks/async_bench.py --latency per-rollout --seeds 0 1 2
    python benchmarks/async_bench.py --latency none --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CALCULATOR = ROOT / "samples" / "calculator"
sys.path[:0] = [str(CALCULATOR), str(ROOT / "samples")]

import voltrl as vl  # noqa: E402

STALENESS = (0, 1, 2)


def environment_latency() -> float:
    """A slow environment's answer time: heavy-tailed, 0.2 to 2 s."""
    return min(2.0, 0.2 + random.lognormvariate(-1.0, 0.9))


@vl.rollout
async def slow_calculator_agent(task: dict[str, Any], llm: vl.LLM) -> float:
    """The calculator agent, after a wait for a slow environment (the question comes from a
    service that takes :func:`environment_latency` to answer)."""
    from agent import calculator_agent

    await asyncio.sleep(environment_latency())
    return await calculator_agent.fn(task, llm)


@vl.rollout
async def slow_turns_calculator_agent(task: dict[str, Any], llm: vl.LLM) -> float:
    """The calculator agent whose every model call first waits for the environment's turn
    (:func:`environment_latency`): the sample's OpenAI client, made slow."""
    import agent
    from openai import AsyncOpenAI

    class SlowEnvironmentClient(AsyncOpenAI):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            create = self.chat.completions.create

            async def after_a_wait(*args: Any, **kwargs: Any) -> Any:
                await asyncio.sleep(environment_latency())
                return await create(*args, **kwargs)

            self.chat.completions.create = after_a_wait  # type: ignore[method-assign]

    agent.AsyncOpenAI = SlowEnvironmentClient  # type: ignore[misc]  # the name it builds by
    return await agent.calculator_agent.fn(task, llm)


AGENTS = {"per-call": "slow_turns_calculator_agent", "per-rollout": "slow_calculator_agent"}


def run_one(seed: int, staleness: int, args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """Train from the warm model with ``max_staleness=staleness``; returns its figures."""
    import yaml
    from demo import write_run_files

    from voltrl.cli import build_from_config
    from voltrl.runtime import free_run_name

    out = args.out / "async-bench"
    run_dir = out / free_run_name(out, f"{args.latency}-seed{seed}-k{staleness}")
    config = yaml.safe_load(write_run_files(run_dir, seed, model, args.steps).read_text())
    val = run_dir / "val.jsonl"
    val.write_text("".join(val.read_text().splitlines(keepends=True)[: args.val_tasks]))
    if args.latency in AGENTS:
        config["agent"] = f"{Path(__file__).resolve()}:{AGENTS[args.latency]}"
    config["algorithm"]["schedule"]["max_staleness"] = staleness
    config["algorithm"].setdefault("validation", {})["every"] = args.steps
    config["trainer"].update(progress=False, max_concurrency=64 * (max(STALENESS) + 1))
    trainer, agent, train, val_data = build_from_config(config)
    started = time.time()
    trainer.fit(agent, train, val_data)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in records if "val/reward_mean" in r]
    updates = [r for r in records if "update_s" in r]
    train_s = updates[-1]["time"] - vals[0]["time"]
    rollouts = sum(r.get("batch/rollouts_with_rows", 0) for r in updates)
    return {
        "seed": seed,
        "max_staleness": staleness,
        "train_s": train_s,
        "fit_s": time.time() - started,
        "rollouts": rollouts,
        "s_per_rollout": train_s / max(rollouts, 1),
        "before": vals[0]["val/reward_mean"],
        "after": vals[-1]["val/reward_mean"],
        "staleness_mean": statistics.mean(r.get("staleness/mean", 0.0) for r in updates),
        "run_dir": str(run_dir),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=10, help="policy updates per run")
    parser.add_argument("--val-tasks", type=int, default=96, help="held-out questions")
    parser.add_argument(
        "--latency", choices=(*AGENTS, "none"), default="per-call",
        help="where the environment makes the agent wait",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("runs"))
    args = parser.parse_args(argv)
    from demo import warm_model

    rows = []
    for seed in args.seeds:
        model = warm_model(seed, args.out / ".cache")
        for staleness in STALENESS:
            row = run_one(seed, staleness, args, model)
            rows.append(row)
            print(json.dumps(row), flush=True)
    for row in rows:
        sync = next(r for r in rows if r["seed"] == row["seed"] and r["max_staleness"] == 0)
        row["speedup"] = sync["s_per_rollout"] / row["s_per_rollout"]
        row["gain_per_min"] = (row["after"] - row["before"]) / (row["train_s"] / 60)
    print(f"\nlatency: {args.latency}; {args.steps} updates of 64 rollouts; seeds {args.seeds}")
    print("| max_staleness | s / trained rollout | speedup vs 0 | held-out after | gain / min |")
    print("|---|---|---|---|---|")
    for k in STALENESS:
        mine = [r for r in rows if r["max_staleness"] == k]

        def med(key: str, rows: list[dict[str, Any]] = mine) -> float:
            return statistics.median(r[key] for r in rows)

        speedups = ", ".join(f"{r['speedup']:.2f}" for r in mine)
        afters = ", ".join(f"{r['after']:.0%}" for r in mine)
        print(
            f"| {k} | {med('s_per_rollout'):.3f} | {med('speedup'):.2f}x ({speedups}) | "
            f"{med('after'):.1%} ({afters}) | {med('gain_per_min'):+.3f} |"
        )
    folder = args.out / "async-bench"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{args.latency}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
