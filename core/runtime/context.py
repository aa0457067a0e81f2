"""What an algorithm works with during a run: :class:`TrainContext` (the store, the run, and
helpers to publish resources, queue rollouts, wait for them, serve gateways and log metrics)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl.errors import VoltRLError
from voltrl.observability.failures import FailureReport
from voltrl.observability.metrics import MetricsLog
from voltrl.observability.trackers import Trackers
from voltrl.resources import Resource, Resources
from voltrl.store.base import Store
from voltrl.types import Rollout, RolloutMode, Run, Task

if TYPE_CHECKING:
    from voltrl.gateway.hosting import ServedGateway
    from voltrl.retry import GatewayRetry


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
    host: str = "127.0.0.1"
    """Where this run's servers bind (the trainer's ``host``)."""
    token: str | None = field(default=None, repr=False)
    """The run's bearer token: the store server and every gateway check it."""
    gateway_retry: GatewayRetry | None = None
    """The trainer's gateway retry settings (None: the defaults)."""
    retry_agent_errors: bool | None = None
    """Whether an agent's own error (it raised, or returned no valid result) is retried up
    to ``max_attempts`` like an infrastructure failure; None: yes, except in ``dev``."""
    failures: FailureReport = field(default_factory=FailureReport)
    """The run's failures: printed as they first occur, checked against the run's limit."""
    cleanup: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    """Run when the session ends, after the algorithm's teardown (stops the gateways)."""
    trainer_resources: dict[str, Resource] = field(default_factory=dict)
    """The resources given to the trainer (its LLMs behind the run's gateways): every version
    published carries them, next to the algorithm's own, e.g. an untrained role's LLM."""
    on_backlog: Callable[[int], None] | None = None
    """Called with the run's unfinished rollouts (queued or running) after each
    :meth:`enqueue`: Ray runners whose number follows the work (``RayRunners(n=function)``)."""
    trackers: Trackers = field(default_factory=Trackers)
    """The run's loggers besides ``metrics.jsonl`` (``Trainer(loggers=...)``): every line of
    :attr:`metrics` goes to them too; :meth:`log_rollouts` hands them sample rollouts."""

    async def serve_gateway(
        self,
        backends: Sequence[str],
        *,
        model: str | None = None,
        model_for_agent: Callable[[str | None], str | None] | None = None,
        backend_api_key: str | None = None,
        backend_headers: Mapping[str, str] | None = None,
        request_token_ids: bool = True,
        retry: GatewayRetry | None = None,
        host: str | None = None,
        reasoning_split: bool = False,
        sampling_for: Callable[[str], Mapping[str, Any] | None] | None = None,
    ) -> ServedGateway:
        """Serve a gateway recording this run's calls in front of ``backends`` (OpenAI base
        URLs), the one way algorithms and the trainer serve one: it binds ``host`` (default:
        the run's), checks the run's token (refused off loopback without one), records each
        call's resources version, and stops when the run ends. ``retry`` overrides the
        trainer's retry settings; ``reasoning_split`` moves the thinking a model writes into
        its content to ``reasoning_content`` (:mod:`voltrl.gateway.reasoning`); ``model_for_agent``
        names the model each call is forwarded with, by its agent name (LoRA adapters per
        role); ``sampling_for`` gives, by rollout mode, the sampling that fills what a request
        leaves out (the run's ``max_tokens``, say, for agents that pass none). Publish an
        ``LLM(endpoint=served.url, gateway=True)``: runners give it the token as its API
        key."""
        from voltrl.gateway.hosting import start_gateway

        served = await start_gateway(
            self.store,
            backends,
            host=host or self.host,
            token=self.token,
            retry=retry or self.gateway_retry,
            model=model,
            model_for_agent=model_for_agent,
            backend_api_key=backend_api_key,
            backend_headers=backend_headers,
            request_token_ids=request_token_ids,
            reasoning_split=reasoning_split,
            sampling_for=sampling_for,
            resources_version=lambda: self.resources_version,
        )
        self.cleanup.push_async_callback(served.stop)
        return served

    async def publish(self, resources: Resources | Mapping[str, Resource]) -> Resources:
        """Save a new resources version: ``resources`` plus the trainer's own
        (:attr:`trainer_resources`); rollouts enqueued from now on run with it. A name that is
        both the algorithm's and the trainer's raises :class:`VoltRLError`: which of the two
        an agent should get would be a guess."""
        items = dict(resources.items if isinstance(resources, Resources) else resources)
        if clash := sorted(set(items) & set(self.trainer_resources)):
            raise VoltRLError(
                f"the algorithm publishes {clash}, which the trainer's resources= also name; the "
                "algorithm serves the model it trains under that name, so give the trainer's "
                "other LLMs names of their own (e.g. 'user_llm' for an untrained role)"
            )
        saved = await self.store.add_resources(Resources(items={**self.trainer_resources, **items}))
        self.resources_version = saved.version
        return saved

    async def enqueue(
        self, tasks: Sequence[Task], mode: RolloutMode, resources_version: int | None = None
    ) -> list[Rollout]:
        """Queue one rollout per task with the latest resources, or with the version given
        (APO runs several candidate templates at once); see :attr:`retry_agent_errors`."""
        retry = self.retry_agent_errors if self.retry_agent_errors is not None else mode != "dev"
        queued = await self.store.enqueue(
            tasks,
            mode=mode,
            run_id=self.run.run_id,
            resources_version=(
                self.resources_version if resources_version is None else resources_version
            ),
            max_attempts=self.max_attempts,
            timeout_s=self.rollout_timeout_s,
            retry_agent_errors=retry,
        )
        if self.on_backlog is not None:
            counts = await self.store.rollout_counts(self.run.run_id)
            self.on_backlog(sum(c.count for c in counts if c.status in ("queued", "running")))
        return queued

    async def wait(self, rollouts: Sequence[Rollout], desc: str = "rollouts") -> list[Rollout]:
        """Wait for rollouts to finish (with a progress bar); returns them in order. Each
        distinct error is printed as it first occurs (see :attr:`failures`), and once all
        have finished, :class:`~voltrl.errors.TooManyFailuresError` stops the run if the
        run's failures reached its limit."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        ids = [r.rollout_id for r in rollouts]
        columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, disable=not self.progress, transient=False) as bar:
            waiting = f"{desc} (waiting for remote runners)"
            task = bar.add_task(waiting if self.remote_runners else desc, total=len(ids))
            while True:
                done = await self.store.wait_for_rollouts(ids, timeout_s=1.0)
                remote = self.remote_runners and not done
                bar.update(task, completed=len(done), description=waiting if remote else desc)
                await self.failures.observe(self.store, done, bar.console)
                if len(done) < len(ids):
                    await self.failures.observe_retries(self.store, self.run.run_id, bar.console)
                if len(done) == len(ids):
                    self.failures.warn_unrewarded(bar.console)
                    self.failures.check()
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
        """Append metrics for a step to the run's metrics log (and the run's loggers)."""
        return self.metrics.log(step, **metrics)

    async def log_rollouts(self, step: int, rollouts: Sequence[Rollout]) -> None:
        """Show a few of ``rollouts`` (a validation's, say) to the run's loggers that take
        sample rollouts (W&B's table: input, reward, final reply); nothing when none does."""
        await self.trackers.log_rollouts(step, rollouts, self.store)
