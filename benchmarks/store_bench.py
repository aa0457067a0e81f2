"""In-process store throughput: the whole rollout lifecycle, as a runner drives it.

Each of N concurrent asyncio workers loops: enqueue one task, claim it, complete it with a
report of 10 spans (~800 bytes of attributes each) and a reward, the way a runner reports
them (inside the ``AttemptResult``). Prints rollouts/s and the p50/p99 latency of one loop per
store and concurrency, and the SQLite/in-memory ratio measured in the same run.

    .venv/bin/python benchmarks/store_bench.py [--duration 4] [--concurrency 1,8,32]
                                                [--stores memory,sqlite]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sqlite3
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from voltrl.store.base import Store
from voltrl.store.memory import InMemoryStore
from voltrl.store.sql import SQLStore
from voltrl.types import AttemptResult, Reward, Span, Task

SPANS_PER_ROLLOUT = 10
WARMUP_S = 0.3


@dataclass
class Result:
    """One measured configuration."""

    store: str
    concurrency: int
    rollouts: int
    seconds: float
    latencies_s: list[float]

    @property
    def per_second(self) -> float:
        return self.rollouts / self.seconds

    def percentile_ms(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_report(rollout_id: str, attempt_id: str, i: int) -> AttemptResult:
    """What a runner reports at the end of a rollout: spans of the agent's steps, a reward."""
    spans = [
        Span(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            name=f"step-{k}",
            end_time=time.time(),
            status="ok",
            attributes={
                "gen_ai.request.model": "qwen2.5-0.5b-instruct",
                "gen_ai.prompt": f"What is {i} + {k}? Think step by step. " * 12,
                "gen_ai.completion": "The answer follows from adding the two numbers. " * 5,
                "gen_ai.usage.prompt_tokens": 120 + k,
                "gen_ai.usage.completion_tokens": 48,
            },
        )
        for k in range(SPANS_PER_ROLLOUT)
    ]
    reward = Reward(rollout_id=rollout_id, attempt_id=attempt_id, value=1.0, step=0)
    return AttemptResult(status="succeeded", reward=1.0, rewards=[reward], spans=spans)


async def worker(store: Store, name: str, stop_at: float, latencies: list[float]) -> int:
    """Run lifecycles until ``stop_at``; returns how many finished."""
    done = 0
    while time.perf_counter() < stop_at:
        start = time.perf_counter()
        await store.enqueue([Task(input={"question": f"{name}-{done}"})])
        claim = await store.claim(name, wait_s=1.0)
        if claim is None:
            continue
        report = make_report(claim.rollout.rollout_id, claim.attempt.attempt_id, done)
        await store.complete(claim.attempt.attempt_id, report)
        latencies.append(time.perf_counter() - start)
        done += 1
        await asyncio.sleep(0)  # let the other workers in, as real awaits would
    return done


async def measure(kind: str, concurrency: int, duration_s: float, workdir: Path) -> Result:
    """One store of ``kind``, fresh, driven by ``concurrency`` workers for ``duration_s``."""
    store: Store = (
        InMemoryStore() if kind == "memory" else SQLStore(workdir / f"bench-{concurrency}.sqlite")
    )
    try:
        warm_until = time.perf_counter() + WARMUP_S
        await asyncio.gather(*(worker(store, f"w{i}", warm_until, []) for i in range(concurrency)))
        latencies: list[float] = []
        start = time.perf_counter()
        counts = await asyncio.gather(
            *(worker(store, f"w{i}", start + duration_s, latencies) for i in range(concurrency))
        )
        return Result(kind, concurrency, sum(counts), time.perf_counter() - start, latencies)
    finally:
        await store.close()


def print_table(results: list[Result]) -> None:
    print(f"{'store':<8} {'workers':>7} {'rollouts/s':>11} {'p50 ms':>8} {'p99 ms':>8}")
    for r in results:
        print(
            f"{r.store:<8} {r.concurrency:>7} {r.per_second:>11.0f} "
            f"{r.percentile_ms(0.50):>8.2f} {r.percentile_ms(0.99):>8.2f}"
        )
    by_key = {(r.store, r.concurrency): r for r in results}
    ratios = [
        (n, by_key["sqlite", n], by_key["memory", n])
        for n in sorted({r.concurrency for r in results})
        if ("sqlite", n) in by_key and ("memory", n) in by_key
    ]
    if ratios:
        print("\nsqlite / memory (same run)")
        print(f"{'workers':>7} {'throughput':>11} {'p50 latency':>12}")
        for n, sql, mem in ratios:
            throughput = sql.per_second / mem.per_second
            latency = sql.percentile_ms(0.5) / mem.percentile_ms(0.5)
            print(f"{n:>7} {throughput:>10.2f}x {latency:>11.2f}x")
        geo = statistics.geometric_mean(s.per_second / m.per_second for _, s, m in ratios)
        print(f"geometric mean throughput ratio: {geo:.2f}x")


def main() -> None:
    """Parse flags, run every configuration, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per configuration")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated worker counts")
    parser.add_argument("--stores", default="memory,sqlite", help="memory and/or sqlite")
    args = parser.parse_args()
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if unknown := set(stores) - {"memory", "sqlite"}:
        parser.error(f"unknown stores {sorted(unknown)}; choose from memory, sqlite")
    levels = [int(n) for n in args.concurrency.split(",") if n.strip()]
    print(
        f"python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, "
        f"{os.cpu_count()} CPUs; {SPANS_PER_ROLLOUT} spans per rollout, "
        f"{args.duration:g} s per configuration\n"
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="voltrl-bench-") as tmp:
        for n in levels:
            for kind in stores:
                results.append(asyncio.run(measure(kind, n, args.duration, Path(tmp))))
    print_table(results)


if __name__ == "__main__":
    main()
