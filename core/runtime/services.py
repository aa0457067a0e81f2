"""The run's services, started in order and stopped in reverse: the store server, the workers
(processes on this machine, or Ray actors), the gateways in front of the trainer's LLMs.

:meth:`Services.start` pushes each stop onto the run's exit stack as it starts the service,
so the stack stops them in reverse: the gateways (with the :class:`TrainContext`'s cleanup),
then the workers (given ``grace_s`` to finish or release their rollouts), then the store
server they reached it through. With ``inline=True`` the workers are tasks of this process
and no store server is started; with ``n_runners=0`` none is started and the server waits
for ``voltrl runner`` processes started elsewhere (:func:`runner_command`); with
``runners=RayRunners(...)`` they are actors on a Ray cluster (:mod:`~voltrl.runtime.ray_runners`),
and the run's servers bind an address its nodes reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl._redact import is_secret_key
from voltrl.agent import LitAgent
from voltrl.errors import VoltRLError
from voltrl.observability.metrics import MetricsLog
from voltrl.resources import LLM, ApiKeys, Resource, Resources, llm_keys
from voltrl.runtime.context import TrainContext
from voltrl.runtime.ray_runners import RayRunnerPool, connect, ray_cluster_summary, runner_host
from voltrl.runtime.run_dir import agent_spec
from voltrl.runtime.runner import RunnerConfig, run_worker
from voltrl.runtime.workers import WorkerPool
from voltrl.store.base import Store
from voltrl.types import Run

if TYPE_CHECKING:
    from voltrl.runtime.trainer import Trainer


class Services:
    """Starts the services of ``trainer``'s runs with its settings; holds the worker pool of
    the run in progress, which a hard exit kills (:meth:`kill_workers`)."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self.pool: WorkerPool | RayRunnerPool | None = None
        self._ray_connected = self._ray_local = False

    async def start(
        self,
        stack: contextlib.AsyncExitStack,
        store: Store,
        run: Run,
        run_dir: Path,
        metrics: MetricsLog,
        agent: LitAgent,
    ) -> TrainContext:
        """Serve the store, start the workers, front the LLMs with gateways and publish them;
        returns the run's context (``stack`` stops it all, in reverse)."""
        t = self._trainer
        token = t.token or os.environ.get("VOLTRL_TOKEN") or secrets.token_urlsafe(24)
        keys = llm_keys(t.resources) if t.resources is not None and not t.record_calls else {}
        self._ray_connected = self._ray_local = False  # this run's, not an earlier one's
        host = await self._join_ray(stack) if t.runners is not None else t.host
        alive, token = await self._start_workers(stack, store, agent, token, run_dir, keys, host)
        ctx = TrainContext(
            store=store,
            run=run,
            run_dir=run_dir,
            metrics=metrics,
            max_attempts=t.max_attempts,
            rollout_timeout_s=t.rollout_timeout_s,
            progress=t.progress,
            workers_alive=alive,
            remote_runners=t.n_runners == 0,
            host=host,
            token=token,
            gateway_retry=t.gateway_retry,
        )
        stack.push_async_callback(ctx.cleanup.aclose)
        if isinstance(self.pool, RayRunnerPool) and callable(self.pool.runners.n):
            ctx.on_backlog = self.pool.demand
        if t.resources is not None:
            resources = t.resources
            if t.record_calls:
                resources = await self._behind_gateways(ctx, resources)
            ctx.trainer_resources = dict(
                resources.items if isinstance(resources, Resources) else resources
            )
            await ctx.publish({})
        return ctx

    def kill_workers(self) -> None:
        """Kill the workers of the run in progress, if any: SIGKILL their processes, or their
        Ray actors (a hard exit: their leases expire and the store retries their rollouts),
        and disconnect from Ray (a Ray started for the run would outlive this process)."""
        if self.pool is not None:
            self.pool.kill()
        if self._ray_connected:
            import ray

            with contextlib.suppress(Exception):  # exiting at once, whatever Ray says
                ray.shutdown()

    async def _join_ray(self, stack: contextlib.AsyncExitStack) -> str:
        """Connect to the Ray cluster of ``Trainer(runners=RayRunners(...))``, unless this
        process is already (it disconnects when the run ends; a Ray it started on this machine
        stops then); returns the host the run's servers bind: one
        the cluster's nodes reach (:func:`~voltrl.runtime.ray_runners.runner_host`)."""
        import ray

        t = self._trainer
        assert t.runners is not None
        kwargs = t.algorithm.ray_init_kwargs()
        self._ray_connected, self._ray_local = await asyncio.to_thread(connect, t.runners, kwargs)
        if self._ray_connected:  # disconnecting ends the run's actors, whatever happened
            stack.push_async_callback(asyncio.to_thread, ray.shutdown)
        return runner_host(t.host, self._ray_local)

    async def _behind_gateways(
        self, ctx: TrainContext, resources: Resources | Mapping[str, Resource]
    ) -> dict[str, Resource]:
        """The resources with each LLM endpoint served through a recording gateway of the
        run (agents get the run's token as their key); the LLM's own key and the
        ``extra_headers`` of its ``sampling_parameters`` (Azure's ``api-key``) go, in memory
        only, to its backend (the published LLM keeps no secret-named header), and its
        sampling fills what an agent's requests leave out."""
        items = dict(resources.items if isinstance(resources, Resources) else resources)
        urls: dict[tuple[str, str, bool, str], str] = {}
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
            sampling, secret_headers = _without_secret_headers(item.sampling_parameters)
            fill = json.dumps([sampling, secret_headers], sort_keys=True, default=repr)
            backend = (item.endpoint, key, item.reasoning_split, fill)  # a gateway per backend
            if backend not in urls:
                served = await ctx.serve_gateway(
                    [item.endpoint],
                    backend_api_key=key,
                    backend_headers=secret_headers,
                    request_token_ids=self._trainer.request_token_ids
                    and self._trainer.algorithm.needs_token_ids,
                    reasoning_split=item.reasoning_split,
                    sampling_for=lambda _mode, sampling=sampling: sampling,
                )
                urls[backend] = served.url
            update = {"endpoint": urls[backend], "gateway": True, "sampling_parameters": sampling}
            items[name] = item.model_copy(update=update)
        return items

    async def _start_workers(
        self,
        stack: contextlib.AsyncExitStack,
        store: Store,
        agent: LitAgent,
        token: str,
        run_dir: Path,
        keys: dict[str, str],
        host: str,
    ) -> tuple[Callable[[], bool], str | None]:
        """Start the workers; returns a check that some can still run rollouts, and the
        token they hold (the one the run's gateways check)."""
        t = self._trainer
        if t.inline and t.n_runners > 0:
            stop = asyncio.Event()
            tasks = [
                asyncio.create_task(
                    run_worker(
                        store,
                        agent,
                        worker_id=f"inline-{i}",
                        config=t.runner_config,
                        stop=stop,
                        keys=ApiKeys(gateway=token, llms=keys),
                    )
                )
                for i in range(t.n_runners)
            ]

            async def stop_inline() -> None:
                stop.set()
                await asyncio.gather(*tasks, return_exceptions=True)

            stack.push_async_callback(stop_inline)
            return (lambda: not all(task.done() for task in tasks)), token

        url, runner_token = await self._serve_store(stack, store, token, host)
        if t.runners is not None:
            ray_pool = RayRunnerPool(
                t.runners,
                agent,
                url,
                token=runner_token,
                config=t.runner_config,
                llm_keys=keys,
                local=self._ray_local,
                job_env=self._ray_connected,
            )
            ray_pool.start()
            self.pool = ray_pool
            stack.push_async_callback(asyncio.to_thread, ray_pool.stop)
            summary = ray_cluster_summary(ray_pool)
            print(f"Ray runners: {summary}; they reach this run at {url}", flush=True)
            return ray_pool.serving, runner_token
        if t.n_runners == 0:
            token_file = None
            if runner_token:  # removed when the run ends: the token dies with it
                token_file = run_dir / "runner.token"
                _write_secret(token_file, runner_token)
                stack.callback(token_file.unlink, missing_ok=True)
            print(f"store server: {url}; waiting for remote runners, started with:", flush=True)
            print(f"  {runner_command(t.runner_config, url, token_file, agent)}", flush=True)
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
            n=t.n_runners,
            token=runner_token,
            config=t.runner_config,
            llm_keys=keys,
        )
        pool.start()
        self.pool = pool
        stack.push_async_callback(asyncio.to_thread, pool.stop)
        return (lambda: bool(pool.processes)), runner_token

    async def _serve_store(
        self, stack: contextlib.AsyncExitStack, store: Store, token: str, host: str
    ) -> tuple[str, str | None]:
        """The URL and token of a store server for ``store`` (started here with ``token``),
        or of the one ``store`` already is."""
        from voltrl.store.http import HTTPStore

        if isinstance(store, HTTPStore):  # a store server already exists: use it directly
            return store.url, store.token
        from voltrl._http.serving import reachable_url, serve
        from voltrl.observability.dashboard import Catalog, dashboard_app
        from voltrl.store.http.endpoints import store_app

        t = self._trainer
        # the store API for the workers, and the run's dashboard under /ui (as voltrl serve)
        app = store_app(store, token=token, ui=dashboard_app(Catalog([store]), token=token))
        try:
            url, stop_server = await serve(app, host, t.port)
        except OSError as exc:  # the YAML's trainer.port, or Trainer(port=...)
            in_use = exc.errno == errno.EADDRINUSE
            reason = "the port is in use (port 0 picks a free one)" if in_use else exc.strerror
            raise VoltRLError(f"cannot listen on {host}:{t.port}: {reason or exc}") from None
        url = reachable_url(url)
        stack.push_async_callback(stop_server)
        return url, token


def runner_command(config: RunnerConfig, url: str, token_file: Path | None, agent: LitAgent) -> str:
    """The ``voltrl runner`` command line that runs ``agent`` with ``config`` for the store
    server at ``url`` (``--workers N``: as many worker processes as wanted). The token is
    read from ``token_file`` (or ``$VOLTRL_TOKEN``): it never appears in the command."""
    parts = ["voltrl runner", f"--store {url}"]
    parts += [f"--token-file {token_file}"] if token_file else []
    parts += [f"--agent {agent_spec(agent)}", "--workers N"]
    parts += [f"--max-concurrency {config.max_concurrency}", f"--lease {config.lease_s:g}"]
    return " ".join(parts)


def _write_secret(path: Path, secret: str) -> None:
    """Write ``secret`` to ``path``, readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.chmod(path, 0o600)


def _without_secret_headers(sampling: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``sampling`` without the secret-named headers of its ``extra_headers`` (an ``api-key``,
    an ``Authorization``), and every one of those headers: a gateway sends them to its backend
    itself (it forwards no client header), so the resources the store keeps never hold a
    secret one."""
    headers = sampling.get("extra_headers")
    if not isinstance(headers, Mapping):
        return dict(sampling), {}
    rest = {k: v for k, v in headers.items() if not is_secret_key(str(k))}
    public = {k: v for k, v in sampling.items() if k != "extra_headers"}
    return ({**public, "extra_headers": rest} if rest else public), {
        str(k): str(v) for k, v in headers.items()
    }
