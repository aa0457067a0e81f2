"""The trainer: wires store, server, runner workers and algorithm for one run.

``Trainer(algorithm=...).fit(agent, train, val)`` and ``.dev(agent, data)`` each:

1. validate the data (nothing is stored if a row is bad);
2. open the run directory ``runs/<name>/`` and its store (SQLite there by default);
3. serve the store over HTTP on loopback, with a fresh bearer token, for the workers (the
   gateways in front of the LLMs check the same token: agents get it as their API key);
4. start ``n_runners`` worker processes (or in-process workers with ``inline=True``); with
   ``n_runners=0`` start none, print the ``voltrl runner`` command that serves this run from
   any machine, and wait for such remote runners;
5. run the algorithm, which publishes resources and enqueues rollouts through
   :class:`TrainContext`;
6. stop everything and return a :class:`RunResult`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from voltrl.agent import FunctionAgent, LitAgent, rollout
from voltrl.algorithms.base import Algorithm
from voltrl.dataset import Dataset, load_tasks
from voltrl.errors import VoltRLError
from voltrl.metrics import MetricsLog, RewardStats, format_stats_table, summarize
from voltrl.resources import LLM, Resource, Resources
from voltrl.runner import RunnerConfig, WorkerPool, run_worker
from voltrl.store.base import Store
from voltrl.types import Rollout, RolloutMode, Run, Task


@dataclass
class RunResult:
    """What a ``fit`` or ``dev`` run produced."""

    run: Run
    run_dir: Path
    rollouts: list[Rollout]
    stats: RewardStats
    by_mode: dict[str, RewardStats]
    metrics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rewards(self) -> list[float | None]:
        """Each rollout's reward, in order (None for failed or unrewarded ones)."""
        return [r.reward for r in self.rollouts]


@dataclass
class TrainContext:
    """What an algorithm works with: the store, the run, and helpers to use them."""

    store: Store
    run: Run
    run_dir: Path
    metrics: MetricsLog
    max_attempts: int
    rollout_timeout_s: float | None
    progress: bool = True
    workers_alive: Callable[[], bool] = lambda: True
    resources_version: int | None = None
    remote_runners: bool = False
    """Whether the rollouts are run by remote runners (the progress bar says it waits)."""

    async def publish(self, resources: Resources | Mapping[str, Resource]) -> Resources:
        """Save a new resources version; rollouts enqueued from now on run with it."""
        if not isinstance(resources, Resources):
            resources = Resources(items=dict(resources))
        saved = await self.store.add_resources(resources)
        self.resources_version = saved.version
        return saved

    async def enqueue(self, tasks: Sequence[Task], mode: RolloutMode) -> list[Rollout]:
        """Queue one rollout per task with the latest resources."""
        return await self.store.enqueue(
            tasks,
            mode=mode,
            run_id=self.run.run_id,
            resources_version=self.resources_version,
            max_attempts=self.max_attempts,
            timeout_s=self.rollout_timeout_s,
        )

    async def wait(self, rollouts: Sequence[Rollout], desc: str = "rollouts") -> list[Rollout]:
        """Wait for rollouts to finish (with a progress bar); returns them in order."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        ids = [r.rollout_id for r in rollouts]
        columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, disable=not self.progress, transient=False) as bar:
            waiting = f"{desc} (waiting for remote runners)"
            task = bar.add_task(waiting if self.remote_runners else desc, total=len(ids))
            while True:
                done = await self.store.wait_for_rollouts(ids, timeout_s=1.0)
                bar.update(task, completed=len(done), description=waiting if not done else desc)
                if len(done) == len(ids):
                    return done
                if not self.workers_alive():
                    raise VoltRLError(
                        f"every worker has died ({len(done)}/{len(ids)} rollouts finished); "
                        "see the worker logs above"
                    )

    async def run_rollouts(
        self, tasks: Sequence[Task], mode: RolloutMode, desc: str | None = None
    ) -> list[Rollout]:
        """Enqueue one rollout per task and wait for all of them."""
        return await self.wait(await self.enqueue(tasks, mode), desc=desc or mode)

    def log(self, step: int, **metrics: Any) -> dict[str, Any]:
        """Append metrics for a step to the run's metrics log."""
        return self.metrics.log(step, **metrics)


class Trainer:
    """Runs an agent with an algorithm: ``fit`` trains, ``dev`` only runs.

    Args:
        algorithm: what to do with the rollouts (default :class:`~voltrl.Baseline`).
        n_runners: worker processes on this machine; 0 starts none: the store is served on
            ``host:port`` and the trainer prints the ``voltrl runner`` command for remote
            runners, then waits for them.
        store: a :class:`Store`, a store spec (path, ``sqlite:///...``, ``memory``,
            ``http://...``), or None for ``<run dir>/store.sqlite``.
        resources: resources to publish before the algorithm starts (e.g. ``{"main_llm":
            LLM(...)}``); algorithms such as LocalRL publish their own.
        run_dir: parent directory of run directories. name: this run's name.
        max_concurrency: rollouts in flight per worker.
        max_attempts: tries per rollout before it fails.
        rollout_timeout_s: per-rollout timeout (the work is cancelled).
        lease_s: how long a worker's claim lives without heartbeats.
        inline: run the workers as tasks in this process (easy debugging) instead of processes.
        progress: show progress bars and the summary table.
        record_calls: put a gateway in front of each LLM in ``resources`` so every call is
            recorded (the agent gets a rollout-scoped endpoint); False hands agents the
            endpoints as given.
        request_token_ids: have those gateways ask backends for token ids and logprobs
            (vLLM's ``return_token_ids``); turn off for hosted APIs that reject the field.
        host, port: where the store server for the runners listens (``port=0``: a free
            port); any host but loopback is reachable from other machines.
        token: the bearer token of the store server and the gateways (default:
            ``$VOLTRL_TOKEN``, else a fresh random one).
    """

    def __init__(
        self,
        algorithm: Algorithm | None = None,
        *,
        n_runners: int = 1,
        store: Store | str | Path | None = None,
        resources: Resources | Mapping[str, Resource] | None = None,
        run_dir: str | Path = "runs",
        name: str | None = None,
        max_concurrency: int = 4,
        max_attempts: int = 3,
        rollout_timeout_s: float | None = None,
        lease_s: float = 30.0,
        inline: bool = False,
        progress: bool = True,
        record_calls: bool = True,
        request_token_ids: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
    ) -> None:
        from voltrl.algorithms.baseline import Baseline

        if n_runners < 0:
            raise ValueError("n_runners must be >= 0")
        self.algorithm = algorithm or Baseline()
        self.n_runners = n_runners
        self.store = store
        self.resources = resources
        self.run_dir = Path(run_dir)
        self.name = name
        self.runner_config = RunnerConfig(
            max_concurrency=max_concurrency,
            lease_s=lease_s,
            claim_wait_s=min(5.0, lease_s),
            grace_s=2.0,  # the trainer stops its workers once nobody waits for their results
        )
        self.max_attempts = max_attempts
        self.rollout_timeout_s = rollout_timeout_s
        self.inline = inline
        self.progress = progress
        self.record_calls = record_calls
        self.request_token_ids = request_token_ids
        self.host, self.port = host, port
        self.token = token

    # ---- public API ---------------------------------------------------------------------
    def fit(
        self,
        agent: LitAgent | Callable[..., Any],
        train_dataset: Dataset,
        val_dataset: Dataset = None,
    ) -> RunResult:
        """Train ``agent`` on ``train_dataset`` (validating on ``val_dataset``)."""
        return asyncio.run(self.fit_async(agent, train_dataset, val_dataset))

    def dev(self, agent: LitAgent | Callable[..., Any], dataset: Dataset) -> RunResult:
        """Run ``agent`` once per task against the current resources, with no training."""
        return asyncio.run(self.dev_async(agent, dataset))

    async def fit_async(
        self,
        agent: LitAgent | Callable[..., Any],
        train_dataset: Dataset,
        val_dataset: Dataset = None,
    ) -> RunResult:
        """:meth:`fit` for callers already inside an event loop."""
        train = load_tasks(train_dataset, split="train")
        val = load_tasks(val_dataset, split="val") if val_dataset is not None else None
        async with self._session("fit", _as_agent(agent)) as ctx:
            await self.algorithm.setup(ctx)
            try:
                await self.algorithm.train(ctx, train, val)
            finally:
                await self.algorithm.teardown(ctx)
            return await self._result(ctx)

    async def dev_async(self, agent: LitAgent | Callable[..., Any], dataset: Dataset) -> RunResult:
        """:meth:`dev` for callers already inside an event loop."""
        tasks = load_tasks(dataset, split="dev")
        async with self._session("dev", _as_agent(agent)) as ctx:
            await self.algorithm.setup(ctx)
            try:
                rollouts = await ctx.run_rollouts(tasks, mode="dev")
                ctx.log(0, **summarize(rollouts).flat("dev/"))
            finally:
                await self.algorithm.teardown(ctx)
            return await self._result(ctx)

    # ---- wiring -------------------------------------------------------------------------
    async def _open_store(self, run_dir: Path) -> tuple[Store, bool]:
        from voltrl.store import open_store

        if isinstance(self.store, Store):
            return self.store, False
        spec = self.store if self.store is not None else run_dir / "store.sqlite"
        return open_store(spec), True

    @contextlib.asynccontextmanager
    async def _session(self, kind: str, agent: LitAgent) -> AsyncIterator[TrainContext]:
        name = self.name or f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        run_dir = self.run_dir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        store, owned = await self._open_store(run_dir)
        run = await store.add_run(
            Run(
                name=name,
                kind=kind,
                algorithm=self.algorithm.name,  # type: ignore[arg-type]
                config=_jsonable(self.algorithm.config()),
            )
        )
        metrics = MetricsLog(run_dir / "metrics.jsonl")
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(_close_if, store, owned)
            stack.callback(metrics.close)
            token = self.token or os.environ.get("VOLTRL_TOKEN") or secrets.token_urlsafe(24)
            alive = await self._start_workers(stack, store, agent, token)
            ctx = TrainContext(
                store=store,
                run=run,
                run_dir=run_dir,
                metrics=metrics,
                max_attempts=self.max_attempts,
                rollout_timeout_s=self.rollout_timeout_s,
                progress=self.progress,
                workers_alive=alive,
                remote_runners=self.n_runners == 0,
            )
            if self.resources is not None:
                resources = self.resources
                if self.record_calls:
                    resources = await self._behind_gateways(stack, ctx, resources, token)
                await ctx.publish(resources)
            yield ctx

    async def _behind_gateways(
        self,
        stack: contextlib.AsyncExitStack,
        ctx: TrainContext,
        resources: Resources | Mapping[str, Resource],
        token: str,
    ) -> dict[str, Resource]:
        """The resources with each LLM endpoint served through a recording gateway that
        checks ``token`` (the agents' API key now); the LLM's own key goes to its backend."""
        from voltrl.gateway import Gateway
        from voltrl.serve import BearerAuth
        from voltrl.server import serve

        items = dict(resources.items if isinstance(resources, Resources) else resources)
        urls: dict[tuple[str, str], str] = {}
        for name, item in items.items():
            if not isinstance(item, LLM) or item.gateway:
                continue
            backend = (item.endpoint, item.api_key)
            if backend not in urls:
                gateway = Gateway(
                    ctx.store,
                    [item.endpoint],
                    resources_version=lambda: ctx.resources_version,
                    request_token_ids=self.request_token_ids,
                    backend_api_key=item.api_key,
                )
                stack.push_async_callback(gateway.aclose)
                url, stop = await serve(BearerAuth(gateway.app, token, ()), self.host, 0)
                url = reachable_url(url)
                stack.push_async_callback(stop)
                urls[backend] = f"{url}/v1"
            update = {"endpoint": urls[backend], "gateway": True, "api_key": token}
            items[name] = item.model_copy(update=update)
        return items

    async def _start_workers(
        self, stack: contextlib.AsyncExitStack, store: Store, agent: LitAgent, token: str
    ) -> Callable[[], bool]:
        """Start the workers; returns a check that some can still run rollouts."""
        if self.inline and self.n_runners > 0:
            stop = asyncio.Event()
            tasks = [
                asyncio.create_task(
                    run_worker(
                        store, agent, worker_id=f"inline-{i}", config=self.runner_config, stop=stop
                    )
                )
                for i in range(self.n_runners)
            ]

            async def stop_inline() -> None:
                stop.set()
                await asyncio.gather(*tasks, return_exceptions=True)

            stack.push_async_callback(stop_inline)
            return lambda: not all(t.done() for t in tasks)

        url, token = await self._serve_store(stack, store, token)
        if self.n_runners == 0:
            print(f"store server: {url}; waiting for remote runners, started with:", flush=True)
            print(f"  {self.runner_command(url, token, agent)}", flush=True)
            return lambda: True
        pool = WorkerPool(agent, url, n=self.n_runners, token=token, config=self.runner_config)
        pool.start()
        stack.push_async_callback(asyncio.to_thread, pool.stop)
        return lambda: bool(pool.processes)

    def runner_command(self, url: str, token: str | None, agent: LitAgent) -> str:
        """The ``voltrl runner`` command line that runs ``agent`` for this trainer's store
        server at ``url`` (``--workers N``: as many worker processes as wanted)."""
        config = self.runner_config
        parts = ["voltrl runner", f"--store {url}"]
        parts += [f"--token {token}"] if token else []
        parts += [f"--agent {_agent_spec(agent)}", "--workers N"]
        parts += [f"--max-concurrency {config.max_concurrency}", f"--lease {config.lease_s:g}"]
        return " ".join(parts)

    async def _serve_store(
        self, stack: contextlib.AsyncExitStack, store: Store, token: str
    ) -> tuple[str, str | None]:
        """The URL and token of a store server for ``store`` (started here with ``token``),
        or of the one ``store`` already is."""
        from voltrl.store.client import HTTPStore

        if isinstance(store, HTTPStore):  # a store server already exists: use it directly
            return store.url, store.token
        from voltrl.serve import server_app
        from voltrl.server import serve

        url, stop_server = await serve(server_app(store, token=token), self.host, self.port)
        url = reachable_url(url)
        stack.push_async_callback(stop_server)
        return url, token

    async def _result(self, ctx: TrainContext) -> RunResult:
        rollouts = await ctx.store.query_rollouts(run_id=ctx.run.run_id)
        modes = sorted({r.mode for r in rollouts})
        by_mode = {m: summarize(r for r in rollouts if r.mode == m) for m in modes}
        result = RunResult(
            run=ctx.run,
            run_dir=ctx.run_dir,
            rollouts=rollouts,
            stats=summarize(rollouts),
            by_mode=by_mode,
            metrics=list(ctx.metrics.records),
        )
        if self.progress:
            from rich.console import Console

            console = Console()
            console.print(format_stats_table(f"run {ctx.run.name}", by_mode))
            console.print(f"run directory: {ctx.run_dir}")
        return result


def _as_agent(agent: LitAgent | Callable[..., Any]) -> LitAgent:
    if isinstance(agent, LitAgent):
        return agent
    if callable(agent):
        return rollout(agent)  # type: ignore[return-value]
    raise TypeError(f"expected a LitAgent or a function, got {type(agent).__name__}")


def reachable_url(url: str) -> str:
    """``url`` of a server bound to every address (``0.0.0.0``, ``::``) with this machine's
    host name instead, so that other machines can use it; other URLs as they are."""
    import socket

    for wildcard in ("http://0.0.0.0:", "http://[::]:"):
        if url.startswith(wildcard):
            return f"http://{socket.gethostname()}:{url[len(wildcard) :]}"
    return url


def _agent_spec(agent: LitAgent) -> str:
    """``MODULE:NAME`` (or ``FILE.py:NAME``) that imports ``agent`` in ``voltrl runner``."""
    target: Any = agent.fn if isinstance(agent, FunctionAgent) else type(agent)
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    if not module or "<" in name:
        return "MODULE:AGENT"
    if module == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        return f"{path}:{name}" if path else "MODULE:AGENT"
    return f"{module}:{name}"


async def _close_if(store: Store, owned: bool) -> None:
    if owned:
        await store.close()


def _jsonable(value: Any) -> Any:
    import json

    return json.loads(json.dumps(value, default=repr))
