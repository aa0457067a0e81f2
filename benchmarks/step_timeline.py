"""Where a LocalRL step's seconds go: from a run's store, per training step, the time from its
tasks being queued to the first claim, to the first model call, to the last rollout finished;
the seconds in that phase with no model call in flight (the framework's idle time: claiming,
the agent's own code, tool calls, the gateway); the update (from ``metrics.jsonl``) and the
gap before the next step's tasks are queued. The idle fraction is the share of the whole run
(rollout phases and gaps) with no call in flight and no update running.

    python benchmarks/step_timeline.py runs/calculator-seed0         # any LocalRL run
    python benchmarks/step_timeline.py --run --steps 5               # a fresh calculator run

``--run`` trains the calculator agent (samples/calculator) with the built-in tiny model for
``--steps`` steps first (no warm-up: the timeline does not depend on what the model learns).
A step is the training rollouts of one resources version (LocalRL publishes one per update).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Step:
    """One step's timeline, in seconds from its tasks being queued."""

    version: int
    rollouts: int
    first_claim: float
    first_call: float
    last_done: float
    idle: float
    """Seconds of the rollout phase (queued to last done) with no model call in flight."""
    update: float | None = None
    gap: float | None = None
    """Seconds from this step's last rollout to the next step's tasks, less the update."""


def busy_seconds(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of ``[start, end]`` covered by at least one of ``intervals``."""
    covered, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return covered


async def timeline(store_spec: str, metrics: Path | None = None) -> list[Step]:
    """The steps of the LocalRL run in ``store_spec`` (its only run, or its last)."""
    from voltrl.store import open_store

    store = open_store(store_spec)
    try:
        run = (await store.list_runs())[-1]
        rollouts = await store.query_rollouts(run_id=run.run_id, mode="train")
        by_version: dict[int, list] = {}
        for r in rollouts:
            by_version.setdefault(r.resources_version or 0, []).append(r)
        steps = []
        for version, group in sorted(by_version.items()):
            calls = [c for r in group for c in await store.get_llm_calls(r.rollout_id)]
            queued = min(r.created_at for r in group)
            done = max(r.finished_at or r.created_at for r in group)
            spans = [(c.started_at, c.ended_at or c.started_at) for c in calls]
            first_call = min((c.started_at for c in calls), default=done)
            steps.append(
                Step(
                    version=version,
                    rollouts=len(group),
                    first_claim=min(r.started_at or done for r in group) - queued,
                    first_call=first_call - queued,
                    last_done=done - queued,
                    idle=(done - queued) - busy_seconds(spans, queued, done),
                )
            )
    finally:
        await store.close()
    updates = _update_seconds(metrics)
    for i, step in enumerate(steps):
        step.update = updates[i] if i < len(updates) else None
        if i + 1 < len(steps):
            queued = min(r.created_at for r in by_version[steps[i + 1].version])
            ended = min(r.created_at for r in by_version[step.version]) + step.last_done
            step.gap = queued - ended - (step.update or 0.0)
    return steps


def _update_seconds(metrics: Path | None) -> list[float]:
    if metrics is None or not metrics.is_file():
        return []
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [float(m["update_s"]) for m in lines if "update_s" in m]


def idle_fraction(steps: list[Step]) -> float:
    """Share of the run's rollout phases and gaps with no call in flight and no update."""
    idle = sum(s.idle + max(s.gap or 0.0, 0.0) for s in steps)
    total = sum(s.last_done + (s.update or 0.0) + max(s.gap or 0.0, 0.0) for s in steps)
    return idle / total if total else 0.0


def table(steps: list[Step]) -> str:
    """The timeline as a Markdown table, then the idle fraction."""
    head = "| step | rollouts | first claim | first call | last done | idle | update | gap |"
    lines = [head, "|" + "---|" * 8]
    for i, s in enumerate(steps, 1):
        update = "-" if s.update is None else f"{s.update:.2f}"
        gap = "-" if s.gap is None else f"{s.gap:.2f}"
        lines.append(
            f"| {i} | {s.rollouts} | {s.first_claim:.2f} | {s.first_call:.2f} | "
            f"{s.last_done:.2f} | {s.idle:.2f} | {update} | {gap} |"
        )
    lines.append(f"\nidle fraction (no call in flight, no update): {idle_fraction(steps):.1%}")
    return "\n".join(lines)


def fresh_run(out: Path, steps: int) -> Path:
    """Train the calculator agent with the tiny model for ``steps`` steps; its run directory."""
    sys.path.insert(0, str(ROOT / "samples" / "calculator"))
    from agent import calculator_agent
    from data import make_tasks

    import voltrl as vl

    algo = vl.LocalRL(
        "tiny",
        schedule={"steps": steps, "tasks_per_step": 8, "group_size": 8},
        sampling={"temperature": 1.0, "max_tokens": 48},
        trajectory={"mode": "trajectory"},
    )
    trainer = vl.Trainer(algo, run_dir=out, name="timeline", max_concurrency=64)
    return trainer.fit(calculator_agent, make_tasks(200, seed=0)).run_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", type=Path, help="a LocalRL run's directory")
    parser.add_argument("--run", action="store_true", help="train a fresh calculator run first")
    parser.add_argument("--steps", type=int, default=5, help="its steps (with --run)")
    parser.add_argument("--out", type=Path, default=Path("runs/benchmarks"), help="where to")
    args = parser.parse_args(argv)
    if args.run:
        run_dir = fresh_run(args.out, args.steps)
    elif args.run_dir is None:
        parser.error("give a run directory, or --run")
    else:
        run_dir = args.run_dir
    steps = asyncio.run(timeline(str(run_dir / "store.sqlite"), run_dir / "metrics.jsonl"))
    print(f"{run_dir}: seconds from each step's tasks being queued")
    print(table(steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
