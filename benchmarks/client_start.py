"""Getting an OpenAI client in each rollout: ``AsyncOpenAI(...)`` built per rollout (what the
samples and the README did) vs ``llm.openai_client()`` (issue 53, section 3).

The ways, measured in one run so that all of them see the same machine:

- ``AsyncOpenAI``: ``AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key)``, the baseline
  (the README's and the quick start's agent): a TLS context of its own (the CA bundle read
  again), a connection pool of its own;
- ``own pool``: ``AsyncOpenAI(..., http_client=httpx2.AsyncClient(verify=ssl_context()))``, what
  the calculator sample and the adapters did before: the process's one TLS context, a new
  connection pool per rollout;
- ``openai_client``: ``llm.openai_client()``: the loop's shared pool.

Parts:

1. ``cost``: CPU µs to get one client (``--clients`` of them, each way in turn, ``--repeats``).
2. ``burst``: ``--rollouts`` (192) rollouts start at once on a new event loop, each getting its
   client and making ``--calls`` chat calls to the fake OpenAI backend
   (``tests/fake_openai_backend.py``) in a process of its own. Reported: how long the loop was
   blocked (the lateness of a 5 ms ticker, summed, and the longest stall), connect timeouts and
   other connection errors the clients met (retried by openai), rollouts whose calls failed
   after their retries, and the wall time; then the same again on that loop (the next step,
   whose clients may find connections open).
3. ``--demo-steps N``: the demo's agent (``samples/calculator``, whose client was ``own pool``)
   trained by LocalRL on the built-in tiny model for N steps of 64 rollouts (as
   ``benchmarks/step_timeline.py --run`` does), a run with each way in turn,
   ``--demo-repeats`` times; seconds per step (tasks queued to the last rollout done, plus the
   update) from the run's store, each run's first step left out.

Ratios are against the baseline measured in the same run; medians over the repeats, the ways
taking turns within each repeat.

    .venv/bin/python benchmarks/client_start.py [--repeats 3] [--demo-steps 6 --demo-repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
from openai import AsyncOpenAI

import voltrl as vl
from voltrl.openai_clients import ssl_context

ROOT = Path(__file__).resolve().parent.parent
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def own_pool(llm: vl.LLM) -> AsyncOpenAI:
    """The calculator sample's and the adapters' client before: a pool per client."""
    return AsyncOpenAI(
        base_url=llm.endpoint,
        api_key=llm.api_key,
        http_client=httpx2.AsyncClient(verify=ssl_context(), timeout=600.0),
    )


WAYS: dict[str, Callable[[vl.LLM], AsyncOpenAI]] = {
    "AsyncOpenAI": lambda llm: AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key),
    "own pool": own_pool,
    "openai_client": lambda llm: llm.openai_client(),
}
BASELINE = "AsyncOpenAI"


# ---- 1. the cost of one client ----------------------------------------------------------------
def client_cost(way: str, n: int) -> float:
    """CPU µs per client, ``n`` clients got one after another inside a running loop."""

    async def run() -> float:
        llm = vl.LLM(endpoint="http://127.0.0.1:9/rollouts/r/attempts/a/v1", model="m")
        make = WAYS[way]
        make(llm)  # imports, the process's TLS context
        start = time.process_time()
        for _ in range(n):
            make(llm)
        return (time.process_time() - start) / n * 1e6

    return asyncio.run(run())


# ---- 2. the start burst -----------------------------------------------------------------------
class ClientErrors(logging.Filter):
    """Counts the connection problems openai's client logs (and keeps its log quiet)."""

    def __init__(self) -> None:
        super().__init__()
        self.connect_timeouts = 0
        self.other_timeouts = 0
        self.connection_errors = 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Encountered a timeout exception"):
            if "Connect" in message or "Pool" in message:
                self.connect_timeouts += 1
            else:
                self.other_timeouts += 1
        elif message.startswith("Encountered exception"):
            self.connection_errors += 1
        return False


def start_backend() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "fake_openai_backend.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("serving "):
        raise RuntimeError("the fake backend did not start")
    return proc, line.split()[1]


async def burst(way: str, url: str, rollouts: int, calls: int) -> dict[str, Any]:
    """``rollouts`` rollouts started at once on this loop, each with its own client."""
    errors = ClientErrors()
    logger = logging.getLogger("openai._base_client")
    logger.addFilter(errors)
    logger.setLevel(logging.DEBUG)
    make = WAYS[way]
    lateness: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        period = 0.005
        while not done.is_set():
            due = time.perf_counter() + period
            await asyncio.sleep(period)
            lateness.append(max(0.0, time.perf_counter() - due))

    async def rollout(k: int) -> bool:
        llm = vl.LLM(endpoint=url, model="fake-model", api_key="k")
        client = make(llm)
        try:
            for _ in range(calls):
                await client.chat.completions.create(
                    model=llm.model, messages=MESSAGES, max_tokens=8
                )
            return True
        except Exception:
            return False
        finally:
            await client.close()

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    start = time.perf_counter()
    cpu = time.process_time()
    results = await asyncio.gather(*(rollout(k) for k in range(rollouts)))
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu
    done.set()
    await tick
    logger.removeFilter(errors)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "blocked_s": sum(lateness),
        "longest_stall_s": max(lateness, default=0.0),
        "connect_timeouts": errors.connect_timeouts,
        "other_timeouts": errors.other_timeouts,
        "connection_errors": errors.connection_errors,
        "failed": results.count(False),
    }


def bursts_in_a_fresh_loop(
    way: str, url: str, rollouts: int, calls: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two bursts on a new loop (a fresh runner worker's): the first step's start, with no
    connection open yet, then the next step's."""

    async def both() -> tuple[dict[str, Any], dict[str, Any]]:
        return await burst(way, url, rollouts, calls), await burst(way, url, rollouts, calls)

    return asyncio.run(both())


# ---- 3. the demo's steps ----------------------------------------------------------------------
def demo_agent(way: str) -> Any:
    """The calculator sample's agent with the client of ``way``."""
    sys.path.insert(0, str(ROOT / "samples" / "calculator"))
    import agent as calculator  # the sample's own tools and prompts

    make = WAYS[way]

    @vl.rollout
    async def calculator_agent(task: dict[str, Any], llm: vl.LLM) -> float:
        client = make(llm).with_options(max_retries=0)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": calculator.SYSTEM},
            {"role": "user", "content": task["question"]},
        ]
        for _ in range(calculator.MAX_TURNS):
            reply = await client.chat.completions.create(
                model=llm.model,
                messages=messages,
                tools=[calculator.CALCULATOR],
                **llm.sampling_parameters,
            )
            message = reply.choices[0].message
            if not message.tool_calls:
                return float(calculator.last_number(message.content) == int(task["answer"]))
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                try:
                    expression = json.loads(call.function.arguments)["expression"]
                    result = calculator.calculate(str(expression))
                except (json.JSONDecodeError, KeyError, TypeError):
                    result = "Error"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return 0.0

    return calculator_agent


def demo_steps(way: str, steps: int, out: Path) -> list[float]:
    """Seconds per step (tasks queued to the last rollout finished, plus the update) of the
    calculator agent with ``way``'s client, trained as ``step_timeline.py --run`` trains it."""
    sys.path.insert(0, str(ROOT / "samples" / "calculator"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from data import make_tasks
    from step_timeline import timeline

    algo = vl.LocalRL(
        "tiny",
        schedule={"steps": steps, "tasks_per_step": 8, "group_size": 8},
        sampling={"temperature": 1.0, "max_tokens": 48},
        trajectory={"mode": "trajectory"},
    )
    name = "client-start-" + way.replace(" ", "-")
    trainer = vl.Trainer(algo, run_dir=out, name=name, max_concurrency=64, progress=False)
    run_dir = trainer.fit(demo_agent(way), make_tasks(200, seed=0)).run_dir
    found = asyncio.run(timeline(str(run_dir / "store.sqlite"), run_dir / "metrics.jsonl"))
    return [s.last_done + (s.update or 0.0) for s in found]


# ---- the report -------------------------------------------------------------------------------
def load_average() -> str:
    """The 1-minute load average now (the machine is shared)."""
    return Path("/proc/loadavg").read_text().split()[0]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200, help="clients per cost measurement")
    parser.add_argument("--rollouts", type=int, default=192, help="rollouts in the burst")
    parser.add_argument("--calls", type=int, default=3, help="chat calls per rollout")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--demo-steps", type=int, default=0, help="0: skip the demo's steps")
    parser.add_argument("--demo-repeats", type=int, default=2, help="demo runs per way")
    parser.add_argument("--out", type=Path, default=Path("runs/benchmarks"))
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"load_average": [], "cost_us": {}, "burst": {}, "demo": {}}

    print(f"1. CPU µs to get one client ({args.clients} per measurement, {args.repeats} repeats)")
    costs: dict[str, list[float]] = {w: [] for w in WAYS}
    for _ in range(args.repeats):
        report["load_average"].append(load_average())
        for way in WAYS:
            costs[way].append(client_cost(way, args.clients))
    base = median(costs[BASELINE])
    for way, values in costs.items():
        m = median(values)
        report["cost_us"][way] = values
        print(f"  {way:14s} {m:9.1f} µs   baseline / this: {base / m:8.1f}x")

    print(f"\n2. start burst: {args.rollouts} rollouts at once, {args.calls} calls each")
    proc, url = start_backend()
    try:
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {
            step: {w: [] for w in WAYS} for step in ("first step", "next step")
        }
        for _ in range(args.repeats):
            report["load_average"].append(load_average())
            for way in WAYS:
                first, after = bursts_in_a_fresh_loop(way, url, args.rollouts, args.calls)
                runs["first step"][way].append(first)
                runs["next step"][way].append(after)
    finally:
        proc.terminate()
        proc.wait(10)
    report["burst"] = runs
    keys = ("wall_s", "cpu_s", "blocked_s", "longest_stall_s")
    for step, by_way in runs.items():
        print(f"  {step}:")
        print("  way                    wall s   cpu s  blocked s  longest stall s  "
              "connect timeouts  conn. errors  failed")  # fmt: skip
        for way, found in by_way.items():
            m = {k: median([r[k] for r in found]) for k in keys}
            timeouts = sum(r["connect_timeouts"] for r in found)
            errors = sum(r["connection_errors"] + r["other_timeouts"] for r in found)
            failed = sum(r["failed"] for r in found)
            print(
                f"  {way:20s} {m['wall_s']:8.2f} {m['cpu_s']:7.2f} {m['blocked_s']:10.2f} "
                f"{m['longest_stall_s']:16.3f} {timeouts:17d} {errors:13d} {failed:7d}"
            )
        b = {k: median([r[k] for r in by_way[BASELINE]]) for k in keys}
        a = {k: median([r[k] for r in by_way["openai_client"]]) for k in keys}
        print(
            f"  baseline / openai_client: wall {b['wall_s'] / a['wall_s']:.1f}x, "
            f"blocked {b['blocked_s'] / max(a['blocked_s'], 1e-9):.1f}x "
            "(timeouts, errors and failures: summed over the repeats)"
        )

    if args.demo_steps:
        print(
            f"\n3. the demo's agent: runs of {args.demo_steps} LocalRL steps of 64 rollouts "
            f"(tiny model), {args.demo_repeats} per way"
        )
        steps: dict[str, list[list[float]]] = {way: [] for way in WAYS}
        for _ in range(args.demo_repeats):
            for way in steps:
                report["load_average"].append(load_average())
                steps[way].append(demo_steps(way, args.demo_steps, args.out))
        report["demo"] = steps
        for way, runs_of_way in steps.items():
            shown = "; ".join(", ".join(f"{v:.1f}" for v in run) for run in runs_of_way)
            every = [v for run in runs_of_way for v in run[1:]]
            ratios = [
                median(base[1:]) / median(run[1:])
                for base, run in zip(steps[BASELINE], runs_of_way, strict=True)
            ]
            print(
                f"  {way:14s} median {median(every):5.2f} s/step, baseline / this per run: "
                f"{', '.join(f'{r:.2f}x' for r in ratios)}   (s/step: {shown})"
            )

    print(f"\nload average (1 min) at each repeat: {', '.join(report['load_average'])}")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
