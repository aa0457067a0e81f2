"""The trainer: runs an agent with an algorithm for one run, from its data to its result.

``Trainer(algorithm=...).fit(agent, train, val)`` and ``.dev(agent, data)`` each:

1. validate the data (nothing is stored if a row is bad);
2. open the run directory ``runs/<name>/`` (:mod:`~voltrl.runtime.run_dir` names it and
   writes its ``train.yaml``) and its store (SQLite there by default);
3. start the run's services (:mod:`~voltrl.runtime.services`): serve the store over HTTP on
   ``host`` (loopback by default), with a fresh bearer token, for the workers; every gateway
   of the run (:meth:`TrainContext.serve_gateway`) binds the same host and checks the same
   token, which runners give agents as their API key;
4. start ``n_runners`` worker processes (or in-process workers with ``inline=True``, or
   actors on a Ray cluster with ``runners=RayRunners(...)``); with
   ``n_runners=0`` start none, write the token to ``<run dir>/runner.token`` (owner-only),
   print the ``voltrl runner`` command that serves this run from any machine (it reads the
   token from that file: the token itself is never printed), and wait for such runners;
5. run the algorithm, which publishes resources and enqueues rollouts through
   :class:`TrainContext`;
6. stop everything, mark the run ``finished``, ``failed`` or ``interrupted`` (Ctrl-C or
   SIGTERM, see :mod:`~voltrl.runtime.interrupt`) and return a :class:`RunResult`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl._console import text as console_text
from voltrl._imports import stop_if_loading
from voltrl.agent import FunctionAgent, LitAgent, rollout
from voltrl.algorithms.base import Algorithm
from voltrl.errors import VoltRLError
from voltrl.observability.failures import FailureReport
from voltrl.observability.metrics import (
    MetricsLog,
    Outcome,
    RewardStats,
    format_stats_table,
    outcome_of,
    summarize,
    summary_rows,
)
from voltrl.observability.trackers import Logger, Trackers, parse_loggers
from voltrl.resources import Resource, Resources
from voltrl.runtime.context import TrainContext
from voltrl.runtime.dataset import Dataset, load_tasks
from voltrl.runtime.interrupt import interruptible
from voltrl.runtime.ray_runners import RayRunners
from voltrl.runtime.run_dir import (
    agent_spec,
    algorithm_config,
    locked_run_dir,
    run_name,
    tracked_config,
    write_train_yaml,
)
from voltrl.runtime.run_setup import check_resume, run_setup, write_setup
from voltrl.runtime.runner import RunnerConfig
from voltrl.runtime.services import Services, runner_command
from voltrl.store.base import Store
from voltrl.store.browse import counts_of
from voltrl.types import Rollout, Run, RunStatus, Task

if TYPE_CHECKING:
    from voltrl.retry import GatewayRetry

ResumeCheck = Callable[[Run, Path], None]
"""Called with the run a ``fit`` resumes and its directory before the run changes; raises
to refuse (:func:`~voltrl.runtime.run_setup.check_resume`)."""


@dataclass
class RunResult:
    """What a ``fit`` or ``dev`` run produced."""

    run: Run
    run_dir: Path
    rollouts: list[Rollout]
    stats: RewardStats
    by_mode: dict[str, RewardStats]
    metrics: list[dict[str, Any]] = field(default_factory=list)
    outcome: Outcome | None = None
    """The run's result (:func:`~voltrl.observability.metrics.run_outcome`): the reward of
    its last validation, else of its dev rollouts, else of its last step."""

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
        runners: where the runner workers run instead of this machine's processes:
            :class:`~voltrl.runtime.ray_runners.RayRunners` places them as actors on a Ray
            cluster (``pip install 'voltrl[ray]'``; see ``docs/ray.md``).
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
            An algorithm that trains no weights (APO) never asks for them.
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
        runners: RayRunners | None = None,
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
        if runners is not None:
            if not isinstance(runners, RayRunners):
                raise TypeError(f"runners: a RayRunners, not {type(runners).__name__}")
            if inline or n_runners != 1:
                raise ValueError(
                    "runners=RayRunners(...) places the workers on Ray: leave n_runners and "
                    "inline alone (RayRunners(n=...) sets how many)"
                )
            runners.check()
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
        self.runners = runners
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
        self.gateway_retry = (
            GatewayRetry.model_validate(gateway_retry) if gateway_retry is not None else None
        )
        self.loggers = parse_loggers(loggers)
        self._services = Services(self)

    # ---- public API ---------------------------------------------------------------------
    def fit(
        self,
        agent: LitAgent | Callable[..., Any],
        train_dataset: Dataset,
        val_dataset: Dataset = None,
    ) -> RunResult:
        """Train ``agent`` on ``train_dataset`` (validating on ``val_dataset``).

        Ctrl-C or SIGTERM stops the run within seconds: it stops claiming, cancels the
        rollouts in flight, lets the algorithm checkpoint (LocalRL does), marks the run
        ``interrupted`` and raises ``KeyboardInterrupt`` (Ctrl-C) or
        :class:`~voltrl.runtime.interrupt.Terminated` (SIGTERM: a ``SystemExit`` with status
        143); a second signal exits at once (status 130 or 143)."""
        stop_if_loading()  # a script's own fit, while a command imports it for its agent
        main = self.fit_async(agent, train_dataset, val_dataset)
        return asyncio.run(interruptible(main, kill=self._services.kill_workers))

    def dev(self, agent: LitAgent | Callable[..., Any], dataset: Dataset) -> RunResult:
        """Run ``agent`` once per task against the current resources, with no training
        (Ctrl-C and SIGTERM as in :meth:`fit`)."""
        stop_if_loading()
        main = self.dev_async(agent, dataset)
        return asyncio.run(interruptible(main, kill=self._services.kill_workers))

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
        setup = run_setup(self, agent_spec(agent), train, val)

        def keeps_setup(previous: Run, run_dir: Path) -> None:
            algorithm = self.algorithm
            config = algorithm_config(algorithm)
            recorded = algorithm.upgraded_config(previous.config)
            tasks = {"train": train, "val": val}
            resumable = algorithm.resumable_settings
            check_resume(previous.name, run_dir, recorded, config, setup, tasks, resumable)

        session = self._session("fit", agent, keeps_setup)
        async with session as ctx, self._reporting_failures(ctx, agent):
            self.write_config(ctx.run_dir, agent, (train_dataset, train), (val_dataset, val))
            write_setup(ctx.run_dir, setup)
            async with self._algorithm(ctx):
                await self.algorithm.train(ctx, train, val)
            return await self._result(ctx)

    async def dev_async(self, agent: LitAgent | Callable[..., Any], dataset: Dataset) -> RunResult:
        """:meth:`dev` for callers already inside an event loop."""
        tasks = load_tasks(dataset, split="dev")
        agent = _as_agent(agent)
        async with self._session("dev", agent) as ctx, self._reporting_failures(ctx, agent):
            async with self._algorithm(ctx):
                rollouts = await ctx.run_rollouts(tasks, mode="dev")
                ctx.log(0, **summarize(rollouts).flat("dev/"))
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
        return write_train_yaml(self, run_dir, agent, train, val)

    def runner_command(self, url: str, token_file: Path | None, agent: LitAgent) -> str:
        """The ``voltrl runner`` command line that runs ``agent`` for this trainer's store
        server at ``url`` (``--workers N``: as many worker processes as wanted). The token is
        read from ``token_file`` (or ``$VOLTRL_TOKEN``): it never appears in the command."""
        return runner_command(self.runner_config, url, token_file, agent)

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

    async def _open_run(
        self,
        store: Store,
        run_dir: Path,
        kind: str,
        resume: bool,
        keeps_setup: ResumeCheck | None,
    ) -> Run:
        """The run record: the latest run of this name when resuming (``running`` again, with
        the settings given now, once ``keeps_setup`` has let it continue), else a new one."""
        name = run_dir.name
        config = algorithm_config(self.algorithm)
        if resume:
            previous = [r for r in await store.list_runs() if r.name == name and r.kind == kind]
            if previous:
                if keeps_setup is not None:
                    keeps_setup(previous[-1], run_dir)
                if previous[-1].status == "running":
                    print(
                        f"run {name!r} is marked running: resuming it (make sure no other "
                        "process still trains it; a process that was killed leaves it so)",
                        flush=True,
                    )
                update = {"status": "running", "finished_at": None, "error": None, "config": config}
                return await store.add_run(previous[-1].model_copy(update=update))
        algorithm = self.algorithm.name
        return await store.add_run(Run(name=name, kind=kind, algorithm=algorithm, config=config))  # type: ignore[arg-type]

    @contextlib.asynccontextmanager
    async def _algorithm(self, ctx: TrainContext) -> AsyncIterator[None]:
        """The algorithm set up for the block and torn down after it. A block that does not
        end well (Ctrl-C, SIGTERM, an error) cancels the run's unfinished rollouts first:
        teardown closes the gateways their agents call, whose refusals (503) would otherwise
        fail the rollouts and send them round the retries."""
        try:
            await self.algorithm.setup(ctx)
            yield
        except BaseException:
            await _cancel_unfinished(ctx.store, ctx.run)
            raise
        finally:
            await self.algorithm.teardown(ctx)

    @contextlib.asynccontextmanager
    async def _session(
        self, kind: str, agent: LitAgent, keeps_setup: ResumeCheck | None = None
    ) -> AsyncIterator[TrainContext]:
        """The run from start to end: name it, open its directory, store and record, start
        its services; when the block ends, stop them and mark the run ``finished``,
        ``interrupted`` (cancelled: Ctrl-C or SIGTERM) or ``failed``. A ``fit`` that resumes
        a run calls ``keeps_setup(the run, its directory)`` first, which raises to refuse."""
        resume = kind == "fit" and self.algorithm.resume
        name = run_name(self.run_dir, self.name, kind, resume)
        run_dir = self.run_dir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        with locked_run_dir(run_dir):
            async with self._opened_run(kind, agent, run_dir, resume, keeps_setup) as ctx:
                yield ctx

    @contextlib.asynccontextmanager
    async def _opened_run(
        self,
        kind: str,
        agent: LitAgent,
        run_dir: Path,
        resume: bool,
        keeps_setup: ResumeCheck | None,
    ) -> AsyncIterator[TrainContext]:
        """:meth:`_session`'s work once its directory is locked."""
        name = run_dir.name
        store, owned = await self._open_store(run_dir)
        try:
            run = await self._open_run(store, run_dir, kind, resume, keeps_setup)
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
                trackers.start(run, run_dir, tracked_config(self, run, run_dir))
                ctx = await self._services.start(stack, store, run, run_dir, metrics, agent)
                ctx.trackers = trackers
                yield ctx
                status = "finished"
        except (asyncio.CancelledError, KeyboardInterrupt):
            status = "interrupted"
            resumable = kind == "fit" and self.algorithm.resumable
            setting = self.algorithm.resume_setting
            resume = f" ({setting}=true continues it)" if resumable else ""
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
            outcome=outcome_of(ctx.run, counts_of(rollouts)),
        )
        if self.progress:
            from rich.console import Console

            console = Console()
            table = format_stats_table(console_text(f"run {ctx.run.name}"), summary_rows(rollouts))
            console.print(table)
            if result.outcome is not None:
                console.print(console_text(result.outcome.line()), soft_wrap=True)
            console.print(console_text(f"run directory: {ctx.run_dir}"))
        return result


def _as_agent(agent: LitAgent | Callable[..., Any]) -> LitAgent:
    if isinstance(agent, LitAgent):
        return agent
    if callable(agent):
        return rollout(agent)  # type: ignore[return-value]
    raise TypeError(f"expected a LitAgent or a function, got {type(agent).__name__}")


async def _cancel_unfinished(store: Store, run: Run) -> None:
    """Cancel the run's queued and running rollouts (their workers stop them at the next
    heartbeat, and their results are rejected): a run that did not finish leaves none behind
    for runners to claim."""
    unfinished = await store.query_rollouts(run_id=run.run_id, status=["queued", "running"])
    for r in unfinished:
        await store.cancel(r.rollout_id)
    if unfinished:
        n = len(unfinished)
        print(f"cancelled {n} unfinished rollout{'' if n == 1 else 's'}", flush=True)


async def _close_if(store: Store, owned: bool) -> None:
    if owned:
        await store.close()
