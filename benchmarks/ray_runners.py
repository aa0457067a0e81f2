"""Ray runners against this machine's worker processes, on a Ray cluster of simulated nodes.

For each number of runners (1, 4, 16, 64 by default, one rollout in flight each, so the two
pools have equal concurrency) and each agent (``none``: returns at once, no LLM call;
``sleep``: sleeps 1 s), a ``Trainer.dev`` round runs with ``n_runners=N`` worker processes
(``WorkerPool``, the baseline) and with ``runners=RayRunners(n=N)`` actors spread over the
cluster's worker nodes. From the store's records it reports:

- rollouts/s: rollouts over the time from the first claim to the last report, once every
  runner has claimed a warm-up rollout (the pools' start-up is paid once a run, and left out);
- claim-to-start p50/p99: from an attempt's claim (the store's clock) to the agent's first
  line (a span it opens), in ms;
- the ratio Ray / local of each, and Ray's overhead per rollout in ms
  (1/throughput_ray - 1/throughput_local, times N);
- idle CPU: the machine's CPU use while the warmed-up runners wait for work (their upkeep,
  which the store server competes with once the CPUs are few).

Then a node is removed while its runner's 1 s sleepers run (``--lease`` seconds leases): the
time from the removal to the start of the last orphaned attempt's retry, against the lease.

    .venv-verl/bin/python benchmarks/ray_runners.py            # ~10 minutes on 2 cores
    .venv-verl/bin/python benchmarks/ray_runners.py --runners 1 4 --agents sleep

Needs Ray (``pip install 'voltrl[ray]'``; ``.venv-verl`` has it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import voltrl as vl
from voltrl.store.memory import InMemoryStore


@vl.rollout
async def none(task: dict, resources: vl.Resources) -> float:
    """Returns at once (no LLM call): the runners' own cost per rollout."""
    if task.get("warm"):
        await asyncio.sleep(0.2)  # long enough for every runner to claim one
    with vl.span("agent"):
        return 1.0


@vl.rollout
async def sleep(task: dict, resources: vl.Resources) -> float:
    """Sleeps a second, as an agent waiting on a tool or a model would."""
    with vl.span("agent"):
        await asyncio.sleep(0.2 if task.get("warm") else 1.0)
        return 1.0


AGENTS = {"none": none, "sleep": sleep}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Measured(vl.Algorithm):
    """Warms every runner up (rounds of short rollouts until each runner has claimed one:
    start-up is paid once a run, and is left out), then runs ``count`` rollouts of
    ``agent``'s kind and keeps them."""

    name = "measured"

    def __init__(self, runners: int, count: int) -> None:
        self.runners, self.count = runners, count
        self.rollouts: list[vl.Rollout] = []
        self.idle_cpu = 0.0

    async def train(self, ctx, train, val) -> None:
        seen: set[str] = set()
        deadline = time.monotonic() + 600
        while len(seen) < self.runners:
            if time.monotonic() > deadline:
                raise SystemExit(f"only {len(seen)} of {self.runners} runners claimed")
            warm = [vl.Task(input={"warm": True}) for _ in range(self.runners)]
            for r in await ctx.run_rollouts(warm, mode="train", desc="warm-up"):
                seen.add((await ctx.store.get_attempts(r.rollout_id))[-1].worker_id)
        # the machine's CPU while the runners wait for work (their own upkeep)
        self.idle_cpu = await asyncio.to_thread(psutil.cpu_percent, 5.0)
        tasks = [vl.Task(input={"i": i}) for i in range(self.count)]
        self.rollouts = await ctx.run_rollouts(tasks, mode="train")


async def measure(run_dir: Path, ray: bool, agent, n: int, count: int) -> dict:
    """``count`` rollouts of ``agent`` on ``n`` runners, Ray actors or local processes."""
    algorithm, store = Measured(n, count), InMemoryStore()
    where = {"runners": vl.RayRunners(n=n, num_cpus=0.5)} if ray else {"n_runners": n}
    trainer = vl.Trainer(
        algorithm, store=store, run_dir=run_dir, progress=False, max_concurrency=1, **where
    )
    await trainer.fit_async(agent, [{"i": 0}])
    rollouts = algorithm.rollouts
    assert all(r.status == "succeeded" for r in rollouts), "a rollout failed"
    starts, ends, waits = [], [], []
    for r in rollouts:
        attempt = (await store.get_attempts(r.rollout_id))[-1]
        span = next(s for s in await store.get_spans(r.rollout_id) if s.name == "agent")
        starts.append(attempt.started_at)
        ends.append(attempt.finished_at)
        waits.append((span.start_time - attempt.started_at) * 1000)
    return {
        "rate": count / (max(ends) - min(starts)),
        "p50": percentile(waits, 0.5),
        "p99": percentile(waits, 0.99),
        "idle_cpu": algorithm.idle_cpu,
    }


async def compare(cluster, runners: list[int], agents: list[str], run_dir: Path) -> None:
    import ray

    head = f"{'agent':>6} {'N':>3} {'pool':>6} {'rollouts/s':>11} {'p50 ms':>8} {'p99 ms':>8}"
    print(f"{head} {'idle CPU':>9}")
    for name in agents:
        for n in runners:
            count = 2 * n if name == "sleep" else max(200, 10 * n)
            seen = {}
            for pool in ("local", "ray"):
                if pool == "ray":
                    ray.init(address=cluster.address, log_to_driver=False)
                try:
                    seen[pool] = await measure(run_dir, pool == "ray", AGENTS[name], n, count)
                finally:
                    if pool == "ray":
                        ray.shutdown()
                m = seen[pool]
                print(
                    f"{name:>6} {n:>3} {pool:>6} {m['rate']:>11.1f} {m['p50']:>8.1f} "
                    f"{m['p99']:>8.1f} {m['idle_cpu']:>8.0f}%",
                    flush=True,
                )
            local, on_ray = seen["local"], seen["ray"]
            overhead = (1 / on_ray["rate"] - 1 / local["rate"]) * n * 1000
            print(
                f"{name:>6} {n:>3}  ray/local: throughput {on_ray['rate'] / local['rate']:.2f}x, "
                f"p50 {on_ray['p50'] / max(local['p50'], 1e-9):.2f}x; overhead "
                f"{overhead:+.1f} ms a rollout ({overhead / (1000 / local['rate'] * n):+.0%})",
                flush=True,
            )


async def node_removal(cluster, run_dir: Path, lease_s: float) -> None:
    import ray

    doomed = cluster.add_node(num_cpus=4, resources={"doomed": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        doomed_id = next(
            n["NodeID"][:8] for n in ray.nodes() if n["Alive"] and "doomed" in n["Resources"]
        )
        store = InMemoryStore()
        runners = vl.RayRunners(n=3, num_cpus=1, max_concurrency=4)
        t = vl.Trainer(
            runners=runners, store=store, run_dir=run_dir, progress=False, lease_s=lease_s
        )
        run = asyncio.create_task(t.dev_async(sleep, [{"i": i} for i in range(60)]))
        while True:
            running = await store.query_rollouts(status=["running"])
            attempts = [a for r in running for a in await store.get_attempts(r.rollout_id)]
            held = [
                a for a in attempts if a.worker_id.endswith(doomed_id) and a.status == "running"
            ]
            if held:
                break
            if run.done():
                raise SystemExit("no rollout ran on the node to remove: run again")
            await asyncio.sleep(0.05)
        removed_at = time.time()
        await asyncio.to_thread(cluster.remove_node, doomed)
        result = await run
        retried = []
        for r in result.rollouts:
            attempts = await store.get_attempts(r.rollout_id)
            if attempts[0].worker_id.endswith(doomed_id) and len(attempts) > 1:
                retried.append(attempts[-1].started_at)
        assert all(r.status == "succeeded" for r in result.rollouts)
        if not retried:
            raise SystemExit("the removed node's attempts all ended before it went: run again")
        print(
            f"node removed with {len(held)} attempt(s) running on it: {len(retried)} orphaned "
            f"rollout(s) retried, the last {max(retried) - removed_at:.1f} s after the removal "
            f"(lease {lease_s:g} s); 0 lost, {len(result.rollouts)} rollouts succeeded once each"
        )
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runners", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--agents", nargs="+", choices=sorted(AGENTS), default=["none", "sleep"])
    parser.add_argument("--nodes", type=int, default=2, help="simulated worker nodes")
    parser.add_argument("--lease", type=float, default=3.0, help="lease of the removal test (s)")
    parser.add_argument("--skip-removal", action="store_true")
    args = parser.parse_args()
    try:
        from ray.cluster_utils import Cluster
    except ImportError:
        sys.exit("needs Ray: pip install 'voltrl[ray]' (.venv-verl has it)")
    cpus = max(args.runners)  # logical CPUs: each runner holds half of one
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=cpus)
        cluster.wait_for_nodes()
        with tempfile.TemporaryDirectory() as tmp:
            print(
                f"{os.cpu_count()} CPUs here; Ray cluster: {args.nodes} simulated nodes", flush=True
            )
            asyncio.run(compare(cluster, args.runners, args.agents, Path(tmp)))
            if not args.skip_removal:
                asyncio.run(node_removal(cluster, Path(tmp), args.lease))
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
