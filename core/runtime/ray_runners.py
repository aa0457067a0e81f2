"""Runner workers as Ray actors: ``Trainer(runners=RayRunners(...))``.

Each actor runs :func:`~voltrl.runtime.runner.run_worker`, as a ``voltrl runner`` worker process
does: it claims rollouts from the run's store server over HTTP with the run's token, under
leases and heartbeats, so exactly-once comes from the store, not from Ray. Ray places the
actors (spread over the nodes by default, with the CPUs, custom resources and ``runtime_env``
asked for) and restarts one whose process or node dies (``max_restarts``); the attempts it held
expire with their leases and the store hands them out again.

:class:`RayRunners` is what the user writes; :class:`RayRunnerPool` is the running pool (the
trainer's :class:`~voltrl.runtime.services.Services` starts and stops it, as it does a
:class:`~voltrl.runtime.workers.WorkerPool`). A supervisor thread of the pool waits on each
actor's ``run`` call: one that ends with an error (the agent cannot be loaded on that node, the
store cannot be reached from it) is dropped with that error in one line; one that retires to
shed abandoned threads is replaced by a fresh actor.

Ray is an extra (``pip install 'voltrl[ray]'``): this module imports it only when a pool
starts, and :meth:`RayRunners.check` names the extra when it is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from voltrl.agent import LitAgent
from voltrl.errors import AgentLoadError, StoreError, VoltRLError
from voltrl.resources import ApiKeys
from voltrl.runtime.runner import RunnerConfig, run_worker

log = logging.getLogger("voltrl.runtime.runner")

RAY_EXTRA = "Ray runners need Ray: pip install 'voltrl[ray]'"
"""What :meth:`RayRunners.check` says when Ray is not installed."""

STRATEGIES = ("SPREAD", "DEFAULT")
"""The placement strategies by name: Ray's ``scheduling_strategy`` of an actor. ``SPREAD``
puts each runner on the least loaded node, ``DEFAULT`` packs them (a strategy object of
``ray.util.scheduling_strategies`` may be given instead)."""


@dataclass
class RayRunners:
    """The run's runner workers as actors on a Ray cluster.

    Args:
        n: how many runners; or a function of the run's unfinished rollouts (queued or
            running, counted each time the algorithm queues some, e.g. at each step) that
            returns how many it wants, so that a cluster with Ray's autoscaler grows with the
            work. :meth:`scale` changes it during a run.
        address: the cluster: ``"auto"`` (the one ``ray start`` runs on this machine), an
            address ``host:6379`` or a ``ray://host:10001`` URL; None: the Ray this process is
            already connected to, else ``$RAY_ADDRESS``, else a Ray started on this machine
            for the run (and stopped after it).
        max_concurrency: rollouts in flight per runner (default: the trainer's).
        num_cpus: CPUs each runner holds on its node (what Ray places by).
        resources: custom Ray resources each runner holds (``{"agents": 1}`` puts runners on
            the nodes started with ``--resources '{"agents": 8}'``).
        runtime_env: the runners' Ray ``runtime_env``: ``{"working_dir": "."}`` sends your
            project to every node (the agent's modules import there), ``py_modules``, ``pip``,
            ``env_vars``... When the trainer connects to Ray it is the job's (Ray takes local
            directories only there), so the run's other Ray workers (VERL's) get it too.
        strategy: where runners go: ``"SPREAD"`` (default: over the nodes), ``"DEFAULT"``
            (Ray's packing), or a ``ray.util.scheduling_strategies`` object.
        max_restarts: how many times Ray restarts a runner whose process or node died (on
            another node if need be); -1 without limit.
    """

    n: int | Callable[[int], int] = 1
    address: str | None = None
    max_concurrency: int | None = None
    num_cpus: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)
    runtime_env: dict[str, Any] | None = None
    strategy: Any = "SPREAD"
    max_restarts: int = 5
    _pool: RayRunnerPool | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.n, int) and self.n < 1:
            raise ValueError("RayRunners: n must be >= 1 (or a function returning how many)")
        if not isinstance(self.n, int) and not callable(self.n):
            raise ValueError("RayRunners: n is a number of runners or a function of the backlog")
        if isinstance(self.strategy, str) and self.strategy not in STRATEGIES:
            raise ValueError(f"RayRunners: strategy {self.strategy!r}: one of {STRATEGIES}")
        if self.num_cpus < 0:
            raise ValueError("RayRunners: num_cpus must be >= 0")
        if self.max_restarts < -1:
            raise ValueError("RayRunners: max_restarts must be >= -1 (-1: without limit)")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RayRunners:
        """From the ``trainer.runners.ray`` mapping of a ``voltrl train`` config."""
        fields = {"n", "address", "max_concurrency", "num_cpus", "resources", "runtime_env"}
        fields |= {"strategy", "max_restarts"}
        if unknown := sorted(set(config) - fields):
            raise ValueError(f"unknown setting {unknown[0]!r}; known: {', '.join(sorted(fields))}")
        if "n" in config and not isinstance(config["n"], int):
            raise ValueError("n: a number of runners")
        return cls(**config)

    def config(self) -> dict[str, Any]:
        """The settings as :meth:`from_config` takes them (``train.yaml``'s
        ``trainer.runners.ray``); a function ``n`` or a strategy object, which YAML cannot
        hold, is left out."""
        out: dict[str, Any] = {"address": self.address, "num_cpus": self.num_cpus}
        out["max_restarts"] = self.max_restarts
        if isinstance(self.n, int):
            out["n"] = self.n
        if isinstance(self.strategy, str):
            out["strategy"] = self.strategy
        if self.max_concurrency is not None:
            out["max_concurrency"] = self.max_concurrency
        if self.resources:
            out["resources"] = dict(self.resources)
        if self.runtime_env:
            out["runtime_env"] = dict(self.runtime_env)
        return out

    def check(self) -> None:
        """Raise :class:`VoltRLError` naming the extra when Ray is not installed."""
        try:
            import ray  # noqa: F401
        except ImportError:
            raise VoltRLError(RAY_EXTRA) from None

    def wanted(self, backlog: int) -> int:
        """How many runners for ``backlog`` unfinished rollouts (at least one)."""
        n = self.n(backlog) if callable(self.n) else self.n
        if not isinstance(n, int):
            raise VoltRLError(f"RayRunners: n({backlog}) returned {n!r}, not a number of runners")
        return max(1, n)

    def scale(self, n: int) -> None:
        """Run ``n`` runners from now on (a function ``n`` is replaced): new ones start, extra
        ones stop claiming, finish their rollouts and leave (safe from any thread, during a
        run or before it)."""
        if n < 1:
            raise ValueError("RayRunners.scale: n must be >= 1")
        self.n = n
        if self._pool is not None:
            self._pool.scale(n)


def connect(runners: RayRunners, ray_init: Mapping[str, Any]) -> tuple[bool, bool]:
    """Connect this process to the runners' Ray cluster, unless it already is (from a thread
    other than the main one, so that Ray leaves the run's SIGTERM handler alone). ``ray_init``:
    what the run's algorithm needs ``ray.init`` called with (VERL: verl's ``runtime_env`` and
    its ``ray_init`` settings); the runners' ``runtime_env`` joins it, as the job's (Ray takes
    local directories, ``working_dir`` and ``py_modules``, only there).

    Returns ``(connected, local)``: whether it connected here (its caller disconnects at the
    run's end, which ends the run's actors), and whether the Ray is one it started on this
    machine for the run."""
    import ray

    if ray.is_initialized():
        return False, False
    kwargs = dict(ray_init)
    given = kwargs.pop("address", None)
    if runners.address and given and runners.address != given:
        raise VoltRLError(
            f"RayRunners(address={runners.address!r}) and the algorithm's Ray address "
            f"{given!r} differ: the runners and the algorithm share one cluster"
        )
    if runners.runtime_env:
        kwargs["runtime_env"] = _merged_env(kwargs.get("runtime_env") or {}, runners.runtime_env)
    address = runners.address or given or os.environ.get("RAY_ADDRESS") or None
    quiet = _Without("SIGTERM handler is not set")  # ours is set: Ray's would replace it
    logging.getLogger("ray._private.worker").addFilter(quiet)
    try:
        if address is None:  # "local": a new Ray, not one ray start left running here
            kwargs.setdefault("include_dashboard", False)
            ray.init(address="local", **kwargs)
            return True, True
        ray.init(address=address, **kwargs)
    except ConnectionError as exc:
        raise VoltRLError(f"cannot reach the Ray cluster at {address!r}: {exc}") from None
    except ValueError as exc:  # e.g. a runtime_env that the job's own one contradicts
        raise VoltRLError(f"cannot join the Ray cluster at {address!r}: {exc}") from None
    finally:
        logging.getLogger("ray._private.worker").removeFilter(quiet)
    return True, False


def _merged_env(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Two Ray ``runtime_env``s as one: ``extra``'s fields win, ``env_vars`` are merged."""
    merged = {**base, **extra}
    if "env_vars" in base and "env_vars" in extra:
        merged["env_vars"] = {**base["env_vars"], **extra["env_vars"]}
    return merged


class _Without(logging.Filter):
    """Drops the log records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def runner_host(host: str, started_here: bool) -> str:
    """Where the run's servers bind for Ray runners: ``host`` as given, unless it is loopback
    on a cluster this process joined, whose nodes may be other machines: then the address Ray
    knows this machine by."""
    import ray

    from voltrl._http.serving import is_loopback

    if started_here or not is_loopback(host):
        return host
    return ray.util.get_node_ip_address()


def ray_cluster_summary(pool: RayRunnerPool) -> str:
    """One line on the pool and its cluster: runners, rollouts each, nodes and CPUs."""
    import ray

    nodes = [node for node in ray.nodes() if node.get("Alive")]
    cpus = sum(node.get("Resources", {}).get("CPU", 0) for node in nodes)
    n = pool.alive
    return (
        f"{n} runner{'' if n == 1 else 's'} x {pool.config.max_concurrency} rollouts on a Ray "
        f"cluster of {len(nodes)} node{'' if len(nodes) == 1 else 's'} ({cpus:g} CPUs)"
    )


@dataclass
class _Runner:
    """One runner of a pool: its actor and the pending result of its ``run`` call."""

    handle: Any
    ref: Any
    leave_by: float | None = None
    """When a runner asked to leave (:meth:`RayRunnerPool.scale`) is killed if its call has
    not ended (``time.monotonic()``); None: staying."""

    @property
    def leaving(self) -> bool:
        return self.leave_by is not None

    def overdue(self) -> bool:
        return self.leave_by is not None and time.monotonic() > self.leave_by


class RayRunnerPool:
    """The runners of a run as Ray actors (see the module docstring), the counterpart of
    :class:`~voltrl.runtime.workers.WorkerPool`: ``start``, ``scale``, ``stop`` and ``kill``.

    :func:`connect` must have connected this process to Ray first; ``local``: Ray was started
    on this machine for the run, so the runners share this process's files and get its
    ``sys.path`` (on a cluster the nodes need ``runtime_env`` or an install instead);
    ``job_env``: the runners' ``runtime_env`` is the job's already (``connect`` set it)."""

    def __init__(
        self,
        runners: RayRunners,
        agent: LitAgent,
        store_url: str,
        *,
        token: str | None,
        config: RunnerConfig,
        llm_keys: Mapping[str, str] | None = None,
        local: bool = False,
        job_env: bool = False,
    ) -> None:
        import ray

        from voltrl.runtime.workers import pickled_agent

        self.runners = runners
        self._actor = ray.remote(RunnerActor)
        self._blob = ray.put(pickled_agent(agent))
        self._url, self._token = store_url, token
        if runners.max_concurrency is not None:
            config = replace(config, max_concurrency=runners.max_concurrency)
        self.config = config
        self._llm_keys = dict(llm_keys or {})
        self._sys_path = list(sys.path) if local else []
        self._job_env = job_env
        self.actors: dict[str, _Runner] = {}
        """The runners by worker id (one dropped for good is removed); under the lock."""
        self.errors: list[VoltRLError] = []
        """Why runners were dropped for good, each a one-line error."""
        self._lock = threading.Lock()
        self._stopping = False
        self._stop_event = threading.Event()  # set with _stopping: wakes the supervisor
        self._next = 0
        self._supervisor: threading.Thread | None = None

    # ---- starting and scaling ------------------------------------------------------------
    def _spawn(self) -> None:
        """Start one runner (the caller holds the lock)."""
        r = self.runners
        options: dict[str, Any] = {
            "num_cpus": r.num_cpus,
            "max_restarts": r.max_restarts,
            "max_task_retries": -1,  # a restarted runner runs its loop again
            "scheduling_strategy": r.strategy,
        }
        if r.resources:
            options["resources"] = dict(r.resources)
        if r.runtime_env and not self._job_env:
            options["runtime_env"] = dict(r.runtime_env)
        worker_id = f"ray-{self._next}"
        self._next += 1
        try:
            handle = self._actor.options(**options).remote()
        except ValueError as exc:  # Ray's refusal of local directories in an actor's env
            raise VoltRLError(
                f"RayRunners.runtime_env: {exc} This process was connected to Ray before the "
                "run: pass the runtime_env to that ray.init, or let the trainer connect "
                "(RayRunners(address=...))"
            ) from None
        ref = handle.run.remote(
            worker_id,
            self._url,
            self._token,
            self._blob,
            self.config,
            self._llm_keys,
            self._sys_path,
        )
        self.actors[worker_id] = _Runner(handle, ref)

    def start(self) -> None:
        """Start the runners and the supervisor thread; warn when no node of the cluster can
        hold a runner (they wait until one joins: a typo in ``resources``, or an autoscaler
        yet to add the node)."""
        _warn_if_unplaceable(self.runners)
        with self._lock:
            for _ in range(self.runners.wanted(0)):
                self._spawn()
        self.runners._pool = self
        self._supervisor = threading.Thread(
            target=self._supervise, name="voltrl-ray-supervisor", daemon=True
        )
        self._supervisor.start()

    def scale(self, n: int) -> None:
        """``n`` runners from now on: start the missing ones, or ask the newest to leave."""
        with self._lock:
            if self._stopping:
                return
            staying = [wid for wid, a in self.actors.items() if not a.leaving]
            for _ in range(n - len(staying)):
                self._spawn()
            grace = self.config.grace_s + 10.0  # as stop() gives them
            for wid in staying[n:] if n < len(staying) else []:
                self.actors[wid].leave_by = time.monotonic() + grace
                self.actors[wid].handle.stop.remote()
        log.info("Ray runners: %d wanted", n)

    def demand(self, backlog: int) -> None:
        """Scale to what :attr:`RayRunners.n` (a function) wants for ``backlog`` unfinished
        rollouts; an error of that function is logged, and the runners stay as they are."""
        try:
            self.scale(self.runners.wanted(backlog))
        except Exception:
            log.exception("RayRunners: n(%d) failed; the runners stay as they are", backlog)

    @property
    def alive(self) -> int:
        """How many runners there are: running, restarting, waiting to be placed or leaving."""
        with self._lock:
            return len(self.actors)

    def serving(self) -> bool:
        """Whether some runner can still run rollouts; when none is left and one failed for
        good, raises :class:`VoltRLError` with the last such error (the agent cannot be loaded
        on the nodes, the store cannot be reached from them) in place of a generic one."""
        if self.alive:
            return True
        if self.errors:
            raise self.errors[-1]
        return False

    # ---- supervision ---------------------------------------------------------------------
    def _supervise(self) -> None:
        """Wait on every runner's ``run`` call; handle each that ends (:meth:`_ended`), and
        kill a leaving runner that outstays its grace (one restarted since it was asked to
        leave, say). An error here is logged and the watch goes on: a supervisor that died
        would leave a run waiting on runners nobody replaces."""
        import ray

        while not self._stop_event.is_set():
            try:
                with self._lock:
                    refs = {a.ref: wid for wid, a in self.actors.items()}
                    overdue = [a for a in self.actors.values() if a.overdue()]
                for runner in overdue:
                    ray.kill(runner.handle, no_restart=True)
                if not refs:
                    self._stop_event.wait(0.5)
                    continue
                done, _ = ray.wait(list(refs), num_returns=1, timeout=0.5)
                for ref in done:
                    self._ended(refs[ref], ref)
            except Exception:
                log.exception("Ray runners: the supervisor hit an error; watching on")
                self._stop_event.wait(0.5)

    def _ended(self, wid: str, ref: Any) -> None:
        """``wid``'s ``run`` call ended: replace a runner that retired to shed threads, drop
        one that left or failed for good (saying why, in one line)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        outcome, error = "stopped", None
        try:
            outcome = ray.get(ref)
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, VoltRLError):
                error = cause
            else:
                why = f"{type(cause).__name__}: {cause}" if cause else _one_line(exc)
                error = VoltRLError(f"runner {wid} failed: {why}")
        except RayActorError as exc:
            error = VoltRLError(f"runner {wid}: its actor died for good: {_one_line(exc)}")
        except Exception as exc:  # Ray's others: unschedulable, runtime env setup failed...
            error = VoltRLError(f"runner {wid}: {type(exc).__name__}: {_one_line(exc)}")
        with self._lock:
            if self._stopping or self.actors.get(wid) is None or self.actors[wid].ref != ref:
                return
            runner = self.actors.pop(wid)
            if runner.leaving:
                pass  # asked to leave (scale): gone, as wanted
            elif error is not None:
                self.errors.append(error)
                log.error("%s", error)
            elif outcome == "recycle":
                log.warning(
                    "runner %s retired: more than %d threads of timed-out or cancelled sync "
                    "rollouts were still running in it (max_abandoned_threads); starting a "
                    "fresh actor",
                    wid,
                    self.config.max_abandoned_threads,
                )
                self._spawn()
        ray.kill(runner.handle, no_restart=True)

    # ---- stopping ------------------------------------------------------------------------
    def _stopped(self) -> list[_Runner]:
        """Mark the pool stopping (no runner starts any more); returns its runners."""
        with self._lock:
            self._stopping = True
            self._stop_event.set()
            self.runners._pool = None
            return list(self.actors.values())

    def stop(self, grace_s: float | None = None) -> None:
        """Ask every runner to stop (rollouts in flight get the config's ``grace_s``, then are
        released to the store), kill those still there after ``grace_s`` (default: that plus
        10 s to report), then every actor."""
        import ray

        runners = self._stopped()
        if grace_s is None:
            grace_s = self.config.grace_s + 10.0
        for runner in runners:
            runner.handle.stop.remote()
        refs = [runner.ref for runner in runners]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for runner in runners:
            ray.kill(runner.handle, no_restart=True)
        if self._supervisor is not None:
            self._supervisor.join()

    def kill(self) -> None:
        """Kill every actor now (a hard exit: their leases expire and the store retries their
        rollouts); none starts any more."""
        import ray

        for runner in self._stopped():
            with contextlib.suppress(Exception):  # exiting anyway
                ray.kill(runner.handle, no_restart=True)


class RunnerActor:
    """A runner on a Ray node: :meth:`run` is :func:`~voltrl.runtime.runner.run_worker`
    against the run's store server, until :meth:`stop` (an async actor: both run on its event
    loop). Ray restarts the actor where its process or node dies and calls :meth:`run` again."""

    def __init__(self) -> None:
        self._stop = asyncio.Event()  # set by a stop that comes before run starts too

    async def run(
        self,
        name: str,
        store_url: str,
        token: str | None,
        agent_blob: bytes,
        config: RunnerConfig,
        llm_keys: dict[str, str],
        sys_path: list[str],
    ) -> str:
        """Run rollouts until stopped; returns ``"recycle"`` when it retired to shed abandoned
        threads (the pool starts a fresh actor), else ``"stopped"``. Raises a one-line
        :class:`AgentLoadError` or :class:`StoreError` naming this node when the agent cannot
        be loaded here or the store cannot be reached from here."""
        import cloudpickle
        import ray

        from voltrl.store.http import HTTPStore

        logging.basicConfig(
            level=logging.WARNING, format=f"%(asctime)s [{name}] %(levelname)s %(message)s"
        )
        sys.path[:0] = [p for p in sys_path if p not in sys.path and os.path.isdir(p)]
        node_id = ray.get_runtime_context().get_node_id()[:8]
        node = f"node {ray.util.get_node_ip_address()} ({node_id})"
        worker_id = f"{name}@{node_id}"  # the attempts say where they ran
        try:
            agent = cloudpickle.loads(agent_blob)
        except Exception as exc:
            raise AgentLoadError(
                f"runner {name} on {node} cannot load the agent: {type(exc).__name__}: "
                f"{exc} (send your project to the nodes with RayRunners(runtime_env="
                "{'working_dir': '.'}) or py_modules, or install it there)"
            ) from None
        store = HTTPStore(store_url, token=token, retries=0)
        try:
            await store.get_resources()
        except Exception as exc:
            await store.close()
            raise StoreError(
                f"runner {name} on {node} cannot reach the run's store at {store_url}: "
                f"{exc} (the trainer binds Trainer(host=...); see docs/ray.md, 'When the "
                "nodes cannot reach the trainer')"
            ) from None
        await store.close()
        recycle = asyncio.Event()
        store = HTTPStore(store_url, token=token)
        try:
            await run_worker(
                store,
                agent,
                worker_id=worker_id,
                config=config,
                stop=self._stop,
                keys=ApiKeys(gateway=token, llms=llm_keys),
                recycle=recycle,
            )
        finally:
            await store.close()
        return "recycle" if recycle.is_set() else "stopped"

    async def stop(self) -> None:
        """Stop claiming; rollouts in flight get the config's ``grace_s``, then are released."""
        self._stop.set()


def _warn_if_unplaceable(runners: RayRunners) -> None:
    """Log a warning when no live node of the cluster has what one runner asks for."""
    import ray

    wanted = {"CPU": runners.num_cpus, **runners.resources}
    nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
    if any(all(node.get(k, 0) >= v for k, v in wanted.items() if v) for node in nodes):
        return
    offered = sorted({k for node in nodes for k in node if not k.startswith("node:")})
    log.warning(
        "Ray runners: no node of the cluster has %s for a runner (the nodes offer %s); the "
        "runners wait until such a node joins",
        wanted,
        ", ".join(offered) or "nothing",
    )


def _one_line(exc: BaseException) -> str:
    """Ray's error as one line (its text spans several), at most 300 characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


__all__ = ["RayRunnerPool", "RayRunners", "RunnerActor", "connect", "runner_host"]
