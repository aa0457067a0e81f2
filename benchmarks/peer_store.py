"""Our store in the peer harness ``shared/bench/peer/store_throughput.py`` (``OursStoreAdapter``).

mode ``http``: our store server (``voltrl serve --no-gateway`` over a durable ``SQLStore`` file
in a temporary directory, bearer token on) runs in its own process; every harness worker is one
runner with its own ``HTTPStore``.
mode ``inproc``: the workers call one ``SQLStore`` object directly.

The harness's lifecycle is enqueue -> claim -> K spans -> complete with a reward. The adapter
does what our runner (``voltrl.runtime.runner``) really does, and nothing cheaper:

- ``claim`` is ``store.claim(worker_id, wait_s=RunnerConfig.claim_wait_s)``, the runner's
  long-poll claim, and opens the attempt's :class:`~voltrl.tracing.RolloutContext`;
- ``add_span`` records a span with ``RolloutContext.span`` (the harness's ~800 bytes of
  attributes), which buffers it on the context: no request, spans travel with the report;
- ``complete`` sends one ``AttemptResult`` with the context's spans and rewards and the reward
  the agent returned, as ``runner._execute`` does.

So a rollout costs 3 requests (enqueue, claim, complete) where the peer's runner makes 14.
The server process is ``voltrl serve`` (the CLI's entry point, run by ``serve_main``): uvloop
and uvicorn's httptools parser, both core dependencies. It can be profiled: ``serve --profile
FILE`` writes cProfile stats at exit (``VOLTRL_PEER_PROFILE=FILE`` makes the adapter pass it).
``VOLTRL_PEER_PLAIN=1`` serves on h11 and asyncio's own loop instead, for reference.

Also runnable on its own::

    .venv/bin/python benchmarks/peer_store.py memory --rollouts 20000 --concurrency 32

runs that many rollouts through the HTTP server and prints its RSS every 1,000 rollouts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from voltrl.resources import Resources
from voltrl.runtime.runner import RunnerConfig
from voltrl.store.base import Store
from voltrl.store.http import HTTPStore
from voltrl.store.sql import SQLStore
from voltrl.tracing import RolloutContext
from voltrl.types import AttemptResult, Task

TOKEN = "peer-bench-token"
HERE = Path(__file__).resolve().parent
PEER = Path(os.environ.get("VOLTRL_PEER_BENCH", HERE.parent.parent / "shared" / "bench" / "peer"))


def _harness() -> Any:
    """The harness module (imported from ``PEER``), for its helpers and child tracking."""
    if str(PEER) not in sys.path:
        sys.path.insert(0, str(PEER))
    import store_throughput

    return store_throughput


@dataclass
class Worker:
    """One runner: its store client and the context of each attempt it runs."""

    store: Store
    contexts: dict[str, RolloutContext] = field(default_factory=dict)


class OursStoreAdapter:
    """The harness's store adapter protocol, for our store server and client."""

    name = "ours"

    def __init__(self, args: argparse.Namespace, rec: Any) -> None:
        self.args = args
        self.rec = rec
        self.mode = "http"
        self.base = ""
        self.server_pid: int | None = None
        self.store: SQLStore | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.attrs: dict[str, Any] = {}

    async def start(self, mode: str) -> None:
        """Start the server process (http) or open the store (inproc)."""
        h = _harness()
        self.mode = mode
        self.attrs = h.make_span_payload(self.args.span_bytes)
        self._tmp = tempfile.TemporaryDirectory(prefix="voltrl-peer-store-")
        db = Path(self._tmp.name) / "store.sqlite"
        if mode == "inproc":
            self.store = SQLStore(db)
            return
        port = h.free_port()
        self.base = f"http://{h.LOOPBACK}:{port}"
        argv = [sys.executable, str(Path(__file__).resolve()), "serve"]
        argv += ["--db", str(db), "--port", str(port)]
        if profile := os.environ.get("VOLTRL_PEER_PROFILE"):
            argv += ["--profile", profile]
        if os.environ.get("VOLTRL_PEER_PLAIN"):
            argv += ["--plain"]
        proc = h.CHILDREN.spawn(argv, log_path=self.args.server_log)
        self.server_pid = proc.pid
        await h.wait_http_ok(f"{self.base}/v1/store/health", timeout=50, proc=proc)

    async def new_worker(self, idx: int) -> Worker:
        """One runner's client: its own ``HTTPStore`` (connection pool), or the shared store."""
        if self.mode == "inproc":
            assert self.store is not None
            return Worker(self.store)
        return Worker(HTTPStore(self.base, TOKEN))

    async def close_worker(self, h: Worker) -> None:
        """Close the runner's connections."""
        if self.mode == "http":
            await h.store.close()

    async def enqueue(self, h: Worker, task_input: dict[str, Any]) -> str:
        """Queue one rollout."""
        (rollout,) = await h.store.enqueue([Task(input=task_input)])
        return rollout.rollout_id

    async def claim(self, h: Worker, worker_id: str) -> tuple[str, str] | None:
        """The runner's long-poll claim; opens the attempt's rollout context."""
        claim = await h.store.claim(worker_id, wait_s=RunnerConfig().claim_wait_s)
        if claim is None:
            return None
        rid, aid = claim.rollout.rollout_id, claim.attempt.attempt_id
        h.contexts[aid] = RolloutContext(
            rollout_id=rid,
            attempt_id=aid,
            task=claim.rollout.task,
            mode=claim.rollout.mode,
            resources=Resources(items={}),
            worker_id=worker_id,
        )
        return rid, aid

    async def add_span(self, h: Worker, rid: str, aid: str, seq: int) -> None:
        """One span of the attempt, recorded (buffered) by its rollout context."""
        with h.contexts[aid].span("openai.chat.completion", **self.attrs):
            pass

    async def complete(self, h: Worker, rid: str, aid: str, seq: int, reward: float) -> None:
        """Report the attempt: status, returned reward, the context's spans, in one request."""
        ctx = h.contexts.pop(aid)
        result = AttemptResult(status="succeeded", reward=reward)
        result.rewards, result.spans = list(ctx.rewards), list(ctx.spans)
        await h.store.complete(aid, result)

    async def server_info(self) -> dict[str, Any]:
        """Counts of rollouts and spans; the server process's CPU seconds and RSS."""
        info: dict[str, Any] = {}
        if self._tmp is not None:
            info.update(_counts(Path(self._tmp.name) / "store.sqlite"))
        if self.server_pid is not None:
            info.update(_harness().proc_stats(self.server_pid))
        return info

    async def stop(self) -> None:
        """Stop the server process and remove the store file."""
        if self.store is not None:
            await self.store.close()
        if self.server_pid is not None:
            _harness().CHILDREN.kill_all()
        if self._tmp is not None:
            self._tmp.cleanup()


def _counts(db: Path) -> dict[str, int]:
    """Rows in the store file (read by a separate connection, as ``voltrl runs`` would)."""
    import sqlite3

    if not db.exists():
        return {}
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as c:
        return {
            f"total_{t}": c.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
            for t in ("rollouts", "attempts", "spans")
        }


# ---- server process -----------------------------------------------------------------------
def serve_main(db: str, port: int, profile: str | None, plain: bool = False) -> None:
    """``voltrl serve --store DB --port PORT --token TOKEN --no-gateway``, run in this process
    through the CLI's own entry point (same code path: uvicorn as ``voltrl._http`` configures
    it, on uvloop with the httptools parser, bearer auth, the durable SQLite store) until SIGTERM.

    ``plain``: for reference only, h11 and asyncio's own loop instead (what a store server gets
    without uvloop and httptools installed). ``profile``: write cProfile stats (CPU time) there
    at exit.
    """
    import voltrl._http.serving
    from voltrl.cli import main as voltrl_main

    if plain:
        voltrl._http.serving.HTTP_PARSER = "h11"
        voltrl._http.serving.run = asyncio.run  # type: ignore[assignment]
    profiler = cProfile.Profile(time.process_time) if profile else None
    argv = ["serve", "--store", db, "--port", str(port), "--token", TOKEN, "--no-gateway"]
    if profiler is not None:
        profiler.enable()
    try:
        status = voltrl_main(argv)
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
    sys.exit(status)


# ---- memory check -------------------------------------------------------------------------
async def memory_check(rollouts: int, concurrency: int, every: int) -> list[tuple[int, float]]:
    """Run ``rollouts`` lifecycles through the HTTP server; (rollouts done, RSS MiB) samples."""
    h = _harness()
    args = argparse.Namespace(span_bytes=800, server_log=None)
    adapter = OursStoreAdapter(args, None)
    await adapter.start("http")
    assert adapter.server_pid is not None
    samples = [(0, h.proc_stats(adapter.server_pid)["rss_mib"])]
    done = 0

    async def worker(i: int) -> None:
        nonlocal done
        w = await adapter.new_worker(i)
        while done < rollouts:
            await adapter.enqueue(w, {"task": f"w{i}", "question": "What is 2+2?"})
            claim = await adapter.claim(w, f"mem-worker-{i}")
            if claim is None:
                continue
            for s in range(1, 11):
                await adapter.add_span(w, *claim, s)
            await adapter.complete(w, *claim, 11, 1.0)
            done += 1
            if done % every == 0:
                samples.append((done, h.proc_stats(adapter.server_pid)["rss_mib"]))
        await adapter.close_worker(w)

    try:
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    finally:
        await adapter.stop()
    return samples


def main() -> None:
    """``serve`` (the server process) or ``memory`` (the RSS check)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("serve", help="run the store server (the adapter starts this)")
    srv.add_argument("--db", required=True)
    srv.add_argument("--port", type=int, required=True)
    srv.add_argument("--profile", default=None, help="write cProfile stats here at exit")
    srv.add_argument(
        "--plain", action="store_true", help="h11 and asyncio's loop (no httptools, no uvloop)"
    )
    mem = sub.add_parser("memory", help="server RSS over many rollouts")
    mem.add_argument("--rollouts", type=int, default=20000)
    mem.add_argument("--concurrency", type=int, default=32)
    mem.add_argument("--every", type=int, default=1000)
    args = parser.parse_args()
    if args.command == "serve":
        serve_main(args.db, args.port, args.profile, args.plain)
        return
    t0 = time.perf_counter()
    samples = asyncio.run(memory_check(args.rollouts, args.concurrency, args.every))
    print(f"{args.rollouts} rollouts in {time.perf_counter() - t0:.1f} s")
    print(f"{'rollouts':>9} {'server RSS MiB':>15}")
    for n, rss in samples:
        print(f"{n:>9} {rss:>15.1f}")


if __name__ == "__main__":
    main()
