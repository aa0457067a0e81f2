"""The trainer: wires store, server, runner workers and algorithm for one run.

``Trainer(algorithm=...).fit(agent, train, val)`` and ``.dev(agent, data)`` each:

1. validate the data (nothing is stored if a row is bad);
2. open the run directory ``runs/<name>/`` and its store (SQLite there by default);
3. serve the store over HTTP on ``host`` (loopback by default), with a fresh bearer token, for
   the workers; every gateway of the run (:meth:`TrainContext.serve_gateway`) binds the same
   host and checks the same token, which runners give agents as their API key;
4. start ``n_runners`` worker processes (or in-process workers with ``inline=True``); with
   ``n_runners=0`` start none, write the token to ``<run dir>/runner.token`` (owner-only),
   print the ``voltrl runner`` command that serves this run from any machine (it reads the
   token from that file: the token itself is never printed), and wait for such runners;
5. run the algorithm, which publishes resources and enqueues rollouts through
   :class:`TrainContext`;
6. stop everything and return a :class:`RunResult`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl.agent import FunctionAgent, LitAgent, rollout
from voltrl.algorithms.base import Algorithm
from voltrl.errors import VoltRLError
from voltrl.observability.failures import FailureReport
from voltrl.observability.metrics import MetricsLog, RewardStats, format_stats_table, summarize
from voltrl.observability.trackers import LOGGERS, Logger, Trackers, parse_loggers
from voltrl.resources import LLM, ApiKeys, Resource, Resources, llm_keys
from voltrl.runtime.context import TrainContext
from voltrl.runtime.dataset import Dataset, load_tasks
from voltrl.runtime.runner import RunnerConfig, run_worker
from voltrl.runtime.workers import WorkerPool
from voltrl.store.base import Store
from voltrl.types import Rollout, Run, RunStatus, Task

if TYPE_CHECKING:
    from voltrl.retry import GatewayRetry


RUN_FILES = ("store.sqlite", "metrics.jsonl")
"""Files whose presence means a run directory holds a run (other files, such as the data a
script wrote there first, do not)."""


def free_run_name(run_dir: str | Path, name: str) -> str:
    """The name a new run called ``name`` gets in ``run_dir``: ``name`` itself unless its
    directory holds a run (:data:`RUN_FILES`), else the first of ``name-2``, ``name-3``...
    that has no directory yet. A script that starts something beside the run (a server
    writing its log into the run directory) picks the name with it first."""
    run_dir = Path(run_dir)
    if not any((run_dir / name / f).exists() for f in RUN_FILES):
        return name
    n = 2
    while (run_dir / f"{name}-{n}").exists():
        n += 1
    return f"{name}-{n}"


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
            LLM(...)}``). Algorithms such as LocalRL publish their own (``main_llm``, the model
            they train); every version they publish keeps these too, under names of their own
            (e.g. ``{"user_llm": LLM(...)}`` for an untrained role's model).
        run_dir: parent directory of run directories. name: this run's name.
        max_concurrency: rollouts in flight per worker.
        max_attempts: tries per rollout before it fails.
        retry_agent_errors: whether an attempt failed by the agent's own code (it raised, or
            returned no valid result) is retried up to ``max_attempts``, as lost workers,
            expired leases and timeouts always are. None (default): yes in ``fit``, not in
            ``dev``, where such an error would only repeat.
        stop_at_failure_rate: the run stops with :class:`~voltrl.errors.TooManyFailuresError`
            once this share of its finished rollouts has failed, checked each time a batch
            (a training step, a validation, the ``dev`` round) has finished: 1.0 (default)
            when every rollout so far failed, e.g. a first step whose rollouts all failed;
            0.5 when half did; None never. Either way each distinct error is printed when it
            first occurs, and counted in a summary at the end of the run.
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
            port); any host but loopback is reachable from other machines. The run's gateways
            (the algorithm's too) bind the same host, on ports of their own.
        token: the bearer token of the store server and the gateways (default:
            ``$VOLTRL_TOKEN``, else a fresh random one). It is never written to the store or
            printed.
        gateway_retry: how the gateways retry backend calls (:class:`~voltrl.retry.
            GatewayRetry`); an algorithm's own setting wins for its gateway.
        loggers: experiment trackers the run's metrics also go to, besides
            ``<run dir>/metrics.jsonl`` (``jsonl``, always on): ``"tensorboard"``,
            ``"wandb"``, ``"mlflow"``, each a name, a mapping with options (``{"name":
            "wandb", "project": "x", "mode": "offline"}``) or a
            :class:`~voltrl.observability.trackers.Logger`; see ``docs/trackers.md``. A missing
            package raises at once, naming the pip extra that installs it.
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
        retry_agent_errors: bool | None = None,
        stop_at_failure_rate: float | None = 1.0,
        rollout_timeout_s: float | None = None,
        lease_s: float = 30.0,
        inline: bool = False,
        progress: bool = True,
        record_calls: bool = True,
        request_token_ids: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        gateway_retry: GatewayRetry | Mapping[str, Any] | None = None,
        loggers: str | Sequence[str | Mapping[str, Any] | Logger] | None = None,
    ) -> None:
        from voltrl.algorithms.baseline import Baseline
        from voltrl.retry import GatewayRetry

        if n_runners < 0:
            raise ValueError("n_runners must be >= 0")
        given = resources.items if isinstance(resources, Resources) else (resources or {})
        if algorithm is not None and (clash := sorted(set(given) & set(algorithm.publishes))):
            raise VoltRLError(
                f"resources={clash}: {type(algorithm).__name__} publishes that name itself "
                "(the model it trains); give the trainer's other LLMs names of their own "
                "(e.g. 'user_llm' for an untrained role)"
            )
        if stop_at_failure_rate is not None and not 0.0 < stop_at_failure_rate <= 1.0:
            raise ValueError("stop_at_failure_rate must be in (0, 1], or None never to stop")
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
        self.retry_agent_errors = retry_agent_errors
        self.stop_at_failure_rate = stop_at_failure_rate
        self.rollout_timeout_s = rollout_timeout_s
        self.inline = inline
        self.progress = progress
        self.record_calls = record_calls
        self.request_token_ids = request_token_ids
        self.host, self.port = host, port
        self.token = token
        self._pool: WorkerPool | None = None
        self.gateway_retry = (
            GatewayRetry.model_validate(gateway_retry) if gateway_retry is not None else None
        )
        self.loggers = parse_loggers(loggers)

    # ---- public API ---------------------------------------------------------------------
    def fit(
        self,
        agent: LitAgent | Callable[..., Any],
        train_dataset: Dataset,
        val_dataset: Dataset = None,
    ) -> RunResult:
        """Train ``agent`` on ``train_dataset`` (validating on ``val_dataset``).

        Ctrl-C stops the run within seconds: it stops claiming, cancels the rollouts in
        flight, lets the algorithm checkpoint (LocalRL does), marks the run ``interrupted``
        and raises ``KeyboardInterrupt``; a second Ctrl-C exits at once (status 130)."""
        return asyncio.run(self._interruptible(self.fit_async(agent, train_dataset, val_dataset)))

    def dev(self, agent: LitAgent | Callable[..., Any], dataset: Dataset) -> RunResult:
        """Run ``agent`` once per task against the current resources, with no training
        (Ctrl-C as in :meth:`fit`)."""
        return asyncio.run(self._interruptible(self.dev_async(agent, dataset)))

    async def _interruptible(self, main: Awaitable[RunResult]) -> RunResult:
        """Await ``main`` with Ctrl-C handled: the first SIGINT cancels it (the session then
        winds down cleanly and marks the run interrupted) and ends in ``KeyboardInterrupt``;
        a second one kills the workers and exits the process at once."""
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        presses = 0

        def on_sigint() -> None:
            nonlocal presses
            presses += 1
            if presses == 1:
                print(
                    "\nCtrl-C: stopping the run (Ctrl-C again to exit at once)",
                    file=sys.stderr,
                    flush=True,
                )
                task.cancel()
                return
            print("exiting now", file=sys.stderr, flush=True)
            if self._pool is not None:
                self._pool.kill()
            os._exit(130)

        handled = threading.current_thread() is threading.main_thread()
        if handled:
            loop.add_signal_handler(signal.SIGINT, on_sigint)
        try:
            return await main
        except asyncio.CancelledError:
            if presses:
                raise KeyboardInterrupt from None
            raise
        finally:
            if handled:
                loop.remove_signal_handler(signal.SIGINT)

    async def fit_async(
        self,
        agent: LitAgent | Callable[..., Any],
        train_dataset: Dataset,
        val_dataset: Dataset = None,
    ) -> RunResult:
        """:meth:`fit` for callers already inside an event loop."""
        train = load_tasks(train_dataset, split="train")
        val = load_tasks(val_dataset, split="val") if val_dataset is not None else None
        agent = _as_agent(agent)
        async with self._session("fit", agent) as ctx, self._reporting_failures(ctx, agent):
            self.write_config(ctx.run_dir, agent, (train_dataset, train), (val_dataset, val))
            try:
                await self.algorithm.setup(ctx)
                await self.algorithm.train(ctx, train, val)
            finally:
                await self.algorithm.teardown(ctx)
            return await self._result(ctx)

    async def dev_async(self, agent: LitAgent | Callable[..., Any], dataset: Dataset) -> RunResult:
        """:meth:`dev` for callers already inside an event loop."""
        tasks = load_tasks(dataset, split="dev")
        agent = _as_agent(agent)
        async with self._session("dev", agent) as ctx, self._reporting_failures(ctx, agent):
            try:
                await self.algorithm.setup(ctx)
                rollouts = await ctx.run_rollouts(tasks, mode="dev")
                ctx.log(0, **summarize(rollouts).flat("dev/"))
            finally:
                await self.algorithm.teardown(ctx)
            return await self._result(ctx)

    def write_config(
        self,
        run_dir: Path,
        agent: LitAgent,
        train: tuple[Dataset, list[Task]],
        val: tuple[Dataset, list[Task] | None],
    ) -> Path | None:
        """Write ``run_dir/train.yaml``, the ``voltrl train`` config that runs this ``fit``
        again (datasets given as objects are written beside it as JSONL), when the algorithm
        is one ``voltrl train`` builds (LocalRL, SFT, Baseline). Returns its path."""
        import json

        import yaml

        if self.algorithm.name not in ("local_rl", "sft", "baseline"):
            return None

        def data_file(source: Dataset, tasks: list[Task], split: str) -> str:
            if isinstance(source, str | Path):
                return str(Path(source).resolve())
            path = run_dir / f"{split}.jsonl"
            path.write_text("".join(json.dumps(t.input) + "\n" for t in tasks))
            return str(path.resolve())

        data = {"train": data_file(*train, "train")}
        if val[1] is not None:
            data["val"] = data_file(val[0], val[1], "val")
        algorithm = {"name": self.algorithm.name, **_jsonable(self.algorithm.config())}
        notes = []
        model = getattr(self.algorithm, "model", None)
        if self.algorithm.name in ("local_rl", "sft") and not isinstance(model, str | Path):
            algorithm["model"] = None
            notes.append("# This run was given a model object: set algorithm.model to its path.")
        spec = _agent_spec(agent)
        if spec == "MODULE:AGENT":
            notes.append("# The agent is not importable by name: set agent to MODULE:AGENT.")
        config = {
            "agent": spec,
            "data": data,
            "algorithm": algorithm,
            "trainer": self._config(run_dir),
        }
        path = run_dir / "train.yaml"
        header = "# Runs this training again: voltrl train " + str(path) + "\n"
        # in the order given: mappings such as lora_adapters route by their order
        body = yaml.safe_dump(config, sort_keys=False)
        path.write_text(header + "".join(n + "\n" for n in notes) + body)
        return path

    def _config(self, run_dir: Path) -> dict[str, Any]:
        """This trainer's arguments as ``voltrl train``'s ``trainer:`` section (the token is
        left out: it is a secret; API keys never serialize)."""
        config: dict[str, Any] = {
            "n_runners": self.n_runners,
            "run_dir": str(run_dir.parent.resolve()),
            "name": run_dir.name,
            "max_concurrency": self.runner_config.max_concurrency,
            "max_attempts": self.max_attempts,
            "retry_agent_errors": self.retry_agent_errors,
            "stop_at_failure_rate": self.stop_at_failure_rate,
            "rollout_timeout_s": self.rollout_timeout_s,
            "lease_s": self.runner_config.lease_s,
            "record_calls": self.record_calls,
            "request_token_ids": self.request_token_ids,
            "host": self.host,
            "port": self.port,
        }
        if isinstance(self.store, str | Path):  # without a password: the YAML is no secret
            config["store"] = _without_password(str(self.store))
        if self.gateway_retry is not None:
            config["gateway_retry"] = self.gateway_retry.model_dump()
        if loggers := [lg for lg in self.loggers if type(lg) is LOGGERS.get(lg.name)]:
            # with the options given (an offline W&B stays offline); one's own are left out
            config["loggers"] = [
                {"name": lg.name, **lg.model_dump(exclude_defaults=True)} for lg in loggers
            ]
        if self.resources is not None:
            items = (
                self.resources.items if isinstance(self.resources, Resources) else self.resources
            )
            config["resources"] = {
                name: item.model_dump(exclude={"kind"})
                for name, item in items.items()
                if isinstance(item, LLM)
            }
        return config

    def _tracked_config(self, run: Run, run_dir: Path) -> dict[str, Any]:
        """What the run's loggers get as its config: the run, the algorithm's config and this
        trainer's arguments (as in ``train.yaml``)."""
        return {
            "run": {"name": run.name, "kind": run.kind, "run_id": run.run_id},
            "algorithm": {"name": run.algorithm, **run.config},
            "trainer": self._config(run_dir),
        }

    # ---- wiring -------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _reporting_failures(self, ctx: TrainContext, agent: LitAgent) -> AsyncIterator[None]:
        """Give ``ctx`` this trainer's failure settings; print the failure summary when the
        run ends, stopped by its failures or not."""
        ctx.retry_agent_errors = self.retry_agent_errors
        target: Any = agent.fn if isinstance(agent, FunctionAgent) else type(agent)
        package = getattr(target, "__module__", "").partition(".")[0]
        ctx.failures = FailureReport(
            self.stop_at_failure_rate,
            agent_package=package if package not in ("", "__main__", "voltrl") else None,
        )
        try:
            yield
        finally:
            ctx.failures.print_summary()

    async def _open_store(self, run_dir: Path) -> tuple[Store, bool]:
        from voltrl.store import open_store

        if isinstance(self.store, Store):
            return self.store, False
        spec = self.store if self.store is not None else run_dir / "store.sqlite"
        return open_store(spec), True

    def _run_name(self, kind: str, resume: bool) -> str:
        """This run's name: the one asked for, unless its directory holds another run and
        this one does not resume it (then ``NAME-2``, ``NAME-3``..., said on the console)."""
        if self.name is None:
            return f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        name = free_run_name(self.run_dir, self.name)
        if resume or name == self.name:
            return self.name
        print(
            f"run {self.name!r} exists in {self.run_dir}; this run is {name!r} "
            "(to continue that run instead, resume it: e.g. LocalRL(resume=True))",
            flush=True,
        )
        return name

    async def _open_run(self, store: Store, name: str, kind: str, resume: bool) -> Run:
        """The run record: the latest run of this name when resuming (``running`` again),
        else a new one."""
        config = _jsonable(self.algorithm.config())
        if resume:
            previous = [r for r in await store.list_runs() if r.name == name and r.kind == kind]
            if previous:
                if previous[-1].status == "running":
                    print(
                        f"run {name!r} is marked running: resuming it (make sure no other "
                        "process still trains it; a process that was killed leaves it so)",
                        flush=True,
                    )
                update = {"status": "running", "finished_at": None, "error": None}
                return await store.add_run(previous[-1].model_copy(update=update))
        algorithm = self.algorithm.name
        return await store.add_run(Run(name=name, kind=kind, algorithm=algorithm, config=config))  # type: ignore[arg-type]

    @contextlib.asynccontextmanager
    async def _session(self, kind: str, agent: LitAgent) -> AsyncIterator[TrainContext]:
        resume = kind == "fit" and self.algorithm.resume
        name = self._run_name(kind, resume)
        run_dir = self.run_dir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        store, owned = await self._open_store(run_dir)
        try:
            run = await self._open_run(store, name, kind, resume)
        except BaseException:
            await _close_if(store, owned)
            raise
        trackers = Trackers(self.loggers)
        metrics = MetricsLog(run_dir / "metrics.jsonl", run.run_id, on_log=trackers.log_metrics)
        status: RunStatus = "failed"
        error: str | None = None
        try:
            async with contextlib.AsyncExitStack() as stack:
                stack.callback(metrics.close)
                trackers.start(run, run_dir, self._tracked_config(run, run_dir))
                ctx = await self._start(stack, store, run, run_dir, metrics, agent)
                ctx.trackers = trackers
                yield ctx
                status = "finished"
        except (asyncio.CancelledError, KeyboardInterrupt):
            status = "interrupted"
            resume = " (resume=True continues it)" if kind == "fit" else ""
            print(f"run {name!r} interrupted{resume}: {run_dir}", flush=True)
            raise
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            try:
                if status != "finished":  # an ended run leaves no rollouts for runners to claim
                    await _cancel_unfinished(store, run)
                # in place: the RunResult already returned holds this Run too
                run.status, run.error, run.finished_at = status, error, time.time()
                await store.add_run(run)
            finally:
                try:  # the loggers get the summary and are closed, whatever happened
                    await trackers.end(store, run)
                finally:
                    await _close_if(store, owned)

    async def _start(
        self,
        stack: contextlib.AsyncExitStack,
        store: Store,
        run: Run,
        run_dir: Path,
        metrics: MetricsLog,
        agent: LitAgent,
    ) -> TrainContext:
        """Serve the store, start the workers, front the LLMs with gateways and publish them;
        returns the run's context (``stack`` stops it all)."""
        token = self.token or os.environ.get("VOLTRL_TOKEN") or secrets.token_urlsafe(24)
        keys = (
            llm_keys(self.resources) if self.resources is not None and not self.record_calls else {}
        )
        alive, token = await self._start_workers(stack, store, agent, token, run_dir, keys)
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
            host=self.host,
            token=token,
            gateway_retry=self.gateway_retry,
        )
        stack.push_async_callback(ctx.cleanup.aclose)
        if self.resources is not None:
            resources = self.resources
            if self.record_calls:
                resources = await self._behind_gateways(ctx, resources)
            ctx.trainer_resources = dict(
                resources.items if isinstance(resources, Resources) else resources
            )
            await ctx.publish({})
        return ctx

    async def _behind_gateways(
        self, ctx: TrainContext, resources: Resources | Mapping[str, Resource]
    ) -> dict[str, Resource]:
        """The resources with each LLM endpoint served through a recording gateway of the
        run (agents get the run's token as their key); the LLM's own key goes, in memory
        only, to its backend."""
        items = dict(resources.items if isinstance(resources, Resources) else resources)
        urls: dict[tuple[str, str, bool], str] = {}
        for name, item in items.items():
            if isinstance(item, LLM) and item.gateway and item.reasoning_split:
                raise VoltRLError(
                    f"resource {name!r}: reasoning_split applies to the gateway the trainer "
                    "puts in front of an endpoint, and this LLM is a gateway already; turn "
                    "the split on where that gateway is served (voltrl serve|gateway "
                    "--reasoning-split)"
                )
            if not isinstance(item, LLM) or item.gateway:
                continue
            key = ApiKeys().fill(name, item).api_key  # the key given, or from api_key_env
            backend = (item.endpoint, key, item.reasoning_split)
            if backend not in urls:
                served = await ctx.serve_gateway(
                    [item.endpoint],
                    backend_api_key=key,
                    request_token_ids=self.request_token_ids,
                    reasoning_split=item.reasoning_split,
                )
                urls[backend] = served.url
            items[name] = item.model_copy(update={"endpoint": urls[backend], "gateway": True})
        return items

    async def _start_workers(
        self,
        stack: contextlib.AsyncExitStack,
        store: Store,
        agent: LitAgent,
        token: str,
        run_dir: Path,
        keys: dict[str, str],
    ) -> tuple[Callable[[], bool], str | None]:
        """Start the workers; returns a check that some can still run rollouts, and the
        token they hold (the one the run's gateways check)."""
        if self.inline and self.n_runners > 0:
            stop = asyncio.Event()
            tasks = [
                asyncio.create_task(
                    run_worker(
                        store,
                        agent,
                        worker_id=f"inline-{i}",
                        config=self.runner_config,
                        stop=stop,
                        keys=ApiKeys(gateway=token, llms=keys),
                    )
                )
                for i in range(self.n_runners)
            ]

            async def stop_inline() -> None:
                stop.set()
                await asyncio.gather(*tasks, return_exceptions=True)

            stack.push_async_callback(stop_inline)
            return (lambda: not all(t.done() for t in tasks)), token

        url, runner_token = await self._serve_store(stack, store, token)
        if self.n_runners == 0:
            token_file = None
            if runner_token:  # removed when the run ends: the token dies with it
                token_file = run_dir / "runner.token"
                _write_secret(token_file, runner_token)
                stack.callback(token_file.unlink, missing_ok=True)
            print(f"store server: {url}; waiting for remote runners, started with:", flush=True)
            print(f"  {self.runner_command(url, token_file, agent)}", flush=True)
            if keys:
                print(
                    f"  (LLMs {sorted(keys)} carry API keys the store never holds: remote runners"
                    " read them from the variables named by LLM(api_key_env=...))",
                    flush=True,
                )
            return (lambda: True), runner_token
        pool = WorkerPool(
            agent,
            url,
            n=self.n_runners,
            token=runner_token,
            config=self.runner_config,
            llm_keys=keys,
        )
        pool.start()
        self._pool = pool
        stack.push_async_callback(asyncio.to_thread, pool.stop)
        return (lambda: bool(pool.processes)), runner_token

    def runner_command(self, url: str, token_file: Path | None, agent: LitAgent) -> str:
        """The ``voltrl runner`` command line that runs ``agent`` for this trainer's store
        server at ``url`` (``--workers N``: as many worker processes as wanted). The token is
        read from ``token_file`` (or ``$VOLTRL_TOKEN``): it never appears in the command."""
        config = self.runner_config
        parts = ["voltrl runner", f"--store {url}"]
        parts += [f"--token-file {token_file}"] if token_file else []
        parts += [f"--agent {_agent_spec(agent)}", "--workers N"]
        parts += [f"--max-concurrency {config.max_concurrency}", f"--lease {config.lease_s:g}"]
        return " ".join(parts)

    async def _serve_store(
        self, stack: contextlib.AsyncExitStack, store: Store, token: str
    ) -> tuple[str, str | None]:
        """The URL and token of a store server for ``store`` (started here with ``token``),
        or of the one ``store`` already is."""
        from voltrl.store.http import HTTPStore

        if isinstance(store, HTTPStore):  # a store server already exists: use it directly
            return store.url, store.token
        from voltrl._http.serving import reachable_url, serve
        from voltrl.cli.serve import server_app

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


def _without_password(spec: str) -> str:
    """A store spec with a database URL's password left out (``user@host``)."""
    scheme, sep, rest = spec.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not (sep and at and ":" in userinfo):
        return spec
    return f"{scheme}://{userinfo.split(':', 1)[0]}@{host}"


def _write_secret(path: Path, secret: str) -> None:
    """Write ``secret`` to ``path``, readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.chmod(path, 0o600)


def _agent_spec(agent: LitAgent) -> str:
    """``MODULE:NAME`` that imports ``agent`` in ``voltrl runner`` and ``voltrl train``, or
    ``FILE.py:NAME`` for a script or a top-level module (found from any directory)."""
    target: Any = agent.fn if isinstance(agent, FunctionAgent) else type(agent)
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    if not module or "<" in name:
        return "MODULE:AGENT"
    if "." not in module:
        path = getattr(sys.modules.get(module), "__file__", None)
        if path and path.endswith(".py"):
            return f"{Path(path).resolve()}:{name}"
        if module == "__main__":
            return "MODULE:AGENT"
    return f"{module}:{name}"


async def _cancel_unfinished(store: Store, run: Run) -> None:
    """Cancel the run's queued and running rollouts (their workers stop them at the next
    heartbeat, and their results are rejected): a run that did not finish leaves none behind
    for runners to claim."""
    unfinished = await store.query_rollouts(run_id=run.run_id, status=["queued", "running"])
    for r in unfinished:
        await store.cancel(r.rollout_id)
    if unfinished:
        print(f"cancelled {len(unfinished)} unfinished rollouts", flush=True)


async def _close_if(store: Store, owned: bool) -> None:
    if owned:
        await store.close()


def _jsonable(value: Any) -> Any:
    import json

    return json.loads(json.dumps(value, default=repr))
