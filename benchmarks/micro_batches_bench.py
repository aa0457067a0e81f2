"""Which rows go through the model together: SFT steps with planned micro-batches against all
of a step's rows in one micro-batch.

Two synthetic batches shaped like the framework samples' rows, on the recipes' student (the
tiny Qwen2, 2 layers of 128, 8 heads):

- ``one agent``: every prompt starts with one 100-token system prompt, then a question of
  10-300 tokens; responses of 20-40 tokens (an AutoGen or Agents SDK agent's calls).
- ``two agents``: half the prompts start with one 300-token system prompt, half with
  another (the SQL agent's writer and reviewer, each with its schema prompt); then 20-60
  tokens; responses of 20-60.

Each configuration runs ``--steps`` SFT steps of ``--batch`` rows (``vl.SFT.fit_batch``: the
same rows in the same order for every configuration), ``--repeats`` times, configurations
taking turns; the table shows the median seconds per step, the tokens the model was fed per
step and the ratio to one micro-batch. ``one micro-batch`` is the plan replaced by all rows
together (their shared prefix still fed once); ``planned (PASS_COST=N)`` is
``plan_micro_batches`` with that cost of a pass.

    .venv/bin/python benchmarks/micro_batches_bench.py [--steps 10] [--repeats 3]
        [--batch 32] [--threads 2]

Run it alone on the machine: other load makes torch steps many times slower.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

import voltrl as vl
from voltrl.algorithms.local import micro_batches
from voltrl.models.kv_cache import MIN_SHARED_PREFIX
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.trajectory import TrainingBatch, TrajectoryConfig, build_trajectory, collate
from voltrl.types import LLMCall, Rollout, Task


def batch_of(
    rows: int,
    seed: int,
    systems: list[list[int]],
    tail: tuple[int, int],
    response: tuple[int, int],
    vocab: int,
) -> TrainingBatch:
    """``rows`` one-call rollouts, each prompt a system prompt (in turn) then a random tail."""
    rng = random.Random(seed)
    trajectories = []
    for k in range(rows):
        prompt = [*systems[k % len(systems)], *rng.choices(range(3, vocab), k=rng.randint(*tail))]
        answer = rng.choices(range(3, vocab), k=rng.randint(*response))
        call = LLMCall(
            rollout_id=f"r{k}",
            attempt_id=f"r{k}-at",
            sequence_id=0,
            prompt_token_ids=prompt,
            response_token_ids=answer,
        )
        rollout = Rollout(
            rollout_id=f"r{k}",
            task=Task(task_id=f"t{k}", input={}),
            status="succeeded",
            reward=1.0,
            final_attempt_id=f"r{k}-at",
        )
        trajectories.append(build_trajectory(rollout, [call]))
    return collate(trajectories, TrajectoryConfig(mode="transition"))


@contextmanager
def planner(pass_cost: int | None) -> Iterator[None]:
    """Plans with ``PASS_COST = pass_cost``; ``None``: every step's rows in one micro-batch."""
    plan, cost = micro_batches.plan_micro_batches, micro_batches.PASS_COST
    if pass_cost is None:
        micro_batches.plan_micro_batches = lambda prompts, ends, **kw: [list(range(len(ends)))]
    else:
        micro_batches.PASS_COST = pass_cost
    try:
        yield
    finally:
        micro_batches.plan_micro_batches, micro_batches.PASS_COST = plan, cost


def fed_per_step(batch: TrainingBatch, size: int, steps: int, pass_cost: int | None) -> float:
    """Tokens fed per step (the shared prefix once), for the rows SFT draws (seed 0)."""
    p = batch.prompt_length
    lengths = [sum(m) for m in batch.prompt_mask]
    prompts = [ids[p - n :] for ids, n in zip(batch.prompt_ids, lengths, strict=True)]
    ends = [len(m) - m[::-1].index(1) for m in batch.response_mask]
    rng, order, total = random.Random(0), [], 0.0
    for _ in range(steps):
        chosen = []
        while len(chosen) < size:  # as SFT.fit_batch draws them
            order = order or rng.sample(range(len(batch)), len(batch))
            chosen.append(order.pop())
        with planner(pass_cost):
            plan = micro_batches.plan_micro_batches(
                [prompts[i] for i in chosen], [ends[i] for i in chosen], max_rows=size
            )
        for group in plan:
            rows = [chosen[k] for k in group]
            common = min(micro_batches._common_length(prompts[rows[0]], prompts[i]) for i in rows)
            prefix = min(common, min(lengths[i] for i in rows) - 1) if len(rows) > 1 else 0
            prefix = prefix if prefix >= MIN_SHARED_PREFIX else 0
            width = max(lengths[i] for i in rows) - prefix + max(ends[i] for i in rows)
            total += prefix + len(rows) * width
    return total / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    tokenizer = build_tiny_tokenizer()
    vocab = len(tokenizer)
    rng = random.Random(0)
    system = [rng.randrange(3, vocab) for _ in range(300)]
    other = [rng.randrange(3, vocab) for _ in range(300)]
    batches = {
        "one agent": batch_of(256, 1, [system[:100]], (10, 300), (20, 40), vocab),
        "two agents": batch_of(256, 2, [system, other], (20, 60), (20, 60), vocab),
    }
    configs: list[tuple[str, int | None]] = [
        ("one micro-batch", None),
        ("planned (PASS_COST=64)", 64),
        ("planned (PASS_COST=256)", 256),
    ]
    torch.set_num_threads(args.threads)
    print(
        f"{args.steps} SFT steps of {args.batch} rows, {args.repeats} repeats, "
        f"{args.threads} torch threads"
    )
    for name, batch in batches.items():
        seconds: dict[str, list[float]] = {c: [] for c, _ in configs}
        for _ in range(args.repeats):
            for config, cost in configs:
                model = build_tiny_model(tokenizer, hidden=128, layers=2, heads=8, kv_heads=4)
                sft = vl.SFT(
                    model,
                    source="unused: fit_batch is given the batch",
                    tokenizer=tokenizer,
                    steps=args.steps,
                    lr=1e-3,
                    batch_size=args.batch,
                    threads=args.threads,
                    seed=0,
                )
                with planner(cost):
                    started = time.perf_counter()
                    sft.fit_batch(model, batch)
                    seconds[config].append((time.perf_counter() - started) / args.steps)
        base = statistics.median(seconds["one micro-batch"])
        print(f"\n{name} ({len(batch)} rows)")
        print(f"{'configuration':<26} {'s/step':>8} {'fed/step':>9} {'vs one':>7}")
        for config, cost in configs:
            step = statistics.median(seconds[config])
            fed = fed_per_step(batch, args.batch, args.steps, cost)
            print(f"{config:<26} {step:8.3f} {fed:9.0f} {base / step:6.2f}x")


if __name__ == "__main__":
    main()
