"""The dashboard at scale and its cost to a training run.

1. **Rollouts page on a big store.** A SQLite store with 100,000 rollouts and 1,000,000 LLM
   calls (10 per rollout, two agents), written with the store's own statements. The dashboard
   serves it on loopback; each kind of rollouts page (default, a status filter, sorted by
   reward, a reward range, text search, an agent filter, a deep page) is fetched repeatedly
   with a real HTTP client; p50 and p99 per kind. Target: p50 < 300 ms.
2. **Cost to a run.** The same short LocalRL run (tests/dashboard_run.py) trains alternately
   with no dashboard and with a dashboard process whose pages are polled as an open browser
   polls them (the runs, run and rollouts pages every 3 s, the run's chart series every 3 s);
   the ratio of the medians of the run's wall time (pairs in alternating order). Target: < 5%
   slower.

    .venv/bin/python benchmarks/dashboard_bench.py            # both (~6 minutes)
    .venv/bin/python benchmarks/dashboard_bench.py --part pages --rollouts 100000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from voltrl._http.serving import serve_in_thread
from voltrl.observability.dashboard import Catalog, dashboard_app
from voltrl.store.sql import SQLStore
from voltrl.store.sql.statements import rollout_row
from voltrl.types import LLMCall, Rollout, Run, Task

ROOT = Path(__file__).resolve().parent.parent


def fill(path: Path, n_rollouts: int, calls_per: int) -> str:
    """A store with ``n_rollouts`` finished rollouts of one run and ``calls_per`` calls each;
    returns the run id."""
    store = SQLStore(path)
    run = asyncio.run(store.add_run(Run(name="big", kind="fit", algorithm="local_rl")))
    rng = random.Random(0)
    conn = store._db.connection()
    sql = store._sql
    t0 = time.time() - n_rollouts
    batch = 5000
    for start in range(0, n_rollouts, batch):
        rollouts, calls = [], []
        for i in range(start, min(start + batch, n_rollouts)):
            status = "succeeded" if rng.random() > 0.03 else "failed"
            created = t0 + i
            r = Rollout(
                run_id=run.run_id,
                task=Task(task_id=f"task-{i // 8}", input={"question": f"what is {i} + {i % 97}?"}),
                mode="train" if i % 10 else "val",
                status=status,
                resources_version=1 + i // 64,
                attempt_count=1 + (rng.random() < 0.05),
                created_at=created,
                started_at=created + 0.1,
                finished_at=created + 0.2 + rng.random() * 5,
                reward=rng.choice([0.0, 0.0, 0.5, 1.0]) if status == "succeeded" else None,
            )
            rollouts.append(rollout_row(r, None))
            for k in range(calls_per):
                call = LLMCall(
                    rollout_id=r.rollout_id,
                    attempt_id="at-bench",
                    sequence_id=k,
                    agent_name="writer" if k % 2 == 0 else "checker",
                    request={"messages": [{"role": "user", "content": f"q{i}"}]},
                    response={"choices": [{"index": 0, "message": {"content": f"a{k}"}}]},
                    prompt_token_ids=list(range(40)),
                    response_token_ids=list(range(8)),
                    response_logprobs=[-0.5] * 8,
                    started_at=created,
                    ended_at=created + 0.05,
                )
                calls.append((r.rollout_id, "at-bench", k, call.model_dump_json()))
        with store._db.lock:
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(sql.insert_rollout, rollouts)
            conn.executemany(sql.insert_call, calls)
            conn.execute("COMMIT")
        print(f"\r  wrote {start + len(rollouts):,} rollouts", end="", flush=True)
    print()
    asyncio.run(store.close())
    return run.run_id


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bench_pages(n_rollouts: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big" / "store.sqlite"
        started = time.time()
        run_id = fill(path, n_rollouts, 10)
        print(f"  filled in {time.time() - started:.0f} s ({path.stat().st_size / 1e9:.2f} GB)")
        pages = {
            "default (newest first)": f"/rollouts?run_id={run_id}",
            "status failed": f"/rollouts?run_id={run_id}&status=failed",
            "sorted by reward": f"/rollouts?run_id={run_id}&sort=reward",
            "reward in [0.5, 1]": f"/rollouts?run_id={run_id}&reward_min=0.5&reward_max=1",
            "text search": f"/rollouts?run_id={run_id}&text=what+is+4242",
            "agent filter": f"/rollouts?run_id={run_id}&agent=checker",
            "page 1000": f"/rollouts?run_id={run_id}&page=1000",
            "runs page": "/",
        }
        with (
            serve_in_thread(dashboard_app(Catalog([path]))) as server,
            httpx.Client(base_url=server.url, timeout=60) as client,
        ):
            print(f"\n  {'page':<24} {'p50 ms':>8} {'p99 ms':>8}  (n={repeats})")
            for name, url in pages.items():
                client.get(url).raise_for_status()  # warm the page cache
                times = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    client.get(url).raise_for_status()
                    times.append((time.perf_counter() - t) * 1000)
                p50, p99 = pct(times, 0.5), pct(times, 0.99)
                flag = "" if p50 < 300 else "  (over 300 ms)"
                print(f"  {name:<24} {p50:8.1f} {p99:8.1f}{flag}")


def train_once(run_dir: Path, name: str, steps: int) -> float:
    started = time.time()
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "dashboard_run.py"), str(run_dir), str(steps), name],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.time() - started


def bench_cost(pairs: int, steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        train_once(root, "warmup", 1)
        plain, watched = [], []
        for k in range(pairs):  # A B, B A, A B...: drift over time falls on both alike
            for watch in (False, True) if k % 2 == 0 else (True, False):
                name = f"{'watched' if watch else 'plain'}-{k}"
                if not watch:
                    plain.append(train_once(root, name, steps))
                    continue
                stop = threading.Event()
                with serve_in_thread(dashboard_app(Catalog([root]))) as server:
                    poller = threading.Thread(target=poll, args=(server.url, stop))
                    poller.start()
                    try:
                        watched.append(train_once(root, name, steps))
                    finally:
                        stop.set()
                        poller.join()
            print(f"  pair {k}: {plain[-1]:.1f} s without, {watched[-1]:.1f} s with the dashboard")
        a, b = statistics.median(plain), statistics.median(watched)
        per_pair = statistics.median(w / p for w, p in zip(watched, plain, strict=True))
        print(f"\n  median run: {a:.1f} s without, {b:.1f} s with the dashboard open")
        print(f"  ratio of medians {b / a:.3f}; median of the pairs' ratios {per_pair:.3f}")


def poll(url: str, stop: threading.Event) -> None:
    """What a browser with the dashboard's pages open asks while the run trains: the runs
    page, the rollouts page and the run's page (its table and its chart series), each
    every 3 s (three tabs)."""
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            try:
                runs = client.get("/").text
                ids = [s.split('"')[0] for s in runs.split('data-run-id="')[1:]]
                client.get("/rollouts")
                for run_id in ids[:1]:
                    client.get(f"/runs/{run_id}")
                    client.get(f"/api/runs/{run_id}")
            except httpx.HTTPError:
                pass
            stop.wait(3.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["pages", "cost", "all"], default="all")
    parser.add_argument("--rollouts", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if args.part in ("pages", "all"):
        print(
            f"rollouts page on a store of {args.rollouts:,} rollouts, {args.rollouts * 10:,} calls"
        )
        bench_pages(args.rollouts, args.repeats)
    if args.part in ("cost", "all"):
        print(
            f"\ncost of an open dashboard to a LocalRL run ({args.steps} steps, {args.pairs} pairs)"
        )
        bench_cost(args.pairs, args.steps)


if __name__ == "__main__":
    main()
