"""How many intra-op threads torch uses for LocalRL, its engine and the supervised warm-up.

A run that is the only big job on its machine should use every CPU it may: on 2 cores, one
thread made the SFT warm-up take 22 s a step where two took 15. But when another process keeps
a core busy, every parallel kernel waits at its barrier for the thread that was descheduled,
and a step gets several times slower (``benchmarks/threads_bench.py``: 2 threads on 2 busy
cores were 3-8x slower than 1). So the default is the usable CPUs less those other processes
keep busy now, measured over a fifth of a second when the run starts (:func:`busy_elsewhere`),
and the start-up line says why when that is fewer than all of them.

:func:`choose_threads` is the one place that picks the number; :func:`use_threads` applies it.
torch keeps the setting per thread once a thread has run a parallel kernel, so code that runs
torch on a thread of its own (the engine, the policy update) applies it there again.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

THREADS_ENV = "OMP_NUM_THREADS"
"""An environment variable that, when set to a positive integer, replaces the default."""


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS has one, lowered to
    a container's CPU quota (cgroup v2 ``cpu.max``) where there is one."""
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, quota)) if quota is not None else cpus


def cgroup_cpu_quota(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> int | None:
    """The CPUs a cgroup v2 quota allows (``"200000 100000"`` is 2), rounded down but at
    least 1; None without a quota (``"max ..."``) or without the file."""
    try:
        quota, period = path.read_text().split()[:2]
        return max(1, int(quota) // int(period))
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class ThreadChoice:
    """A thread count and why it is that."""

    threads: int
    why: str
    """``"given"``, ``"$OMP_NUM_THREADS"``, or what the machine showed (``"every usable
    CPU"``, ``"1.0 of 2 CPUs busy with other processes"``)."""


def cpu_ticks(cpus: set[int] | None = None) -> tuple[int, int] | None:
    """``(busy ticks of the CPUs ``cpus`` (default: the machine's), ticks of this process and
    its descendants)`` from ``/proc`` (busy: user, nice, system, irq, softirq and steal time;
    a process: its threads' user and system time, and that of the children it has reaped), or
    None where ``/proc`` is not there. The descendants are the run's own: its worker
    processes, a server it started."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        busy += user + nice + system + irq + softirq + steal
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:  # the command name, in parentheses, may hold spaces: split after it
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it ended meanwhile
        pid = int(entry.name)
        parent[pid] = int(stat[1])
        ticks[pid] = sum(int(x) for x in stat[11:15])  # utime, stime, cutime, cstime
    ours, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        me = frontier.pop()
        for pid in [p for p, pp in parent.items() if pp == me and p not in ours]:
            ours.add(pid)
            frontier.append(pid)
    return busy, sum(ticks.get(p, 0) for p in ours)


def busy_elsewhere(window_s: float = 0.2) -> float | None:
    """How many of the CPUs this process may run on other processes keep busy, measured over
    ``window_s`` seconds (their busy time less that of this process and its descendants);
    None where it cannot be told."""
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = set(affinity(0)) if affinity else None
    before = cpu_ticks(cpus)
    start = time.monotonic()
    time.sleep(window_s)
    after = cpu_ticks(cpus)
    if before is None or after is None:
        return None
    ticks = (time.monotonic() - start) * os.sysconf("SC_CLK_TCK")
    busy = ((after[0] - before[0]) - (after[1] - before[1])) / ticks
    return min(max(0.0, busy), float(len(cpus) if cpus else os.cpu_count() or 1))


def choose_threads(threads: int | None = None, *, busy: float | None = None) -> ThreadChoice:
    """The intra-op thread count to use: ``threads`` when given, else ``$OMP_NUM_THREADS``
    when it is a positive integer, else :func:`usable_cpus` less the CPUs other processes
    keep busy (``busy``, else measured now: :func:`busy_elsewhere`), at least 1."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        return ThreadChoice(threads, "given")
    env = os.environ.get(THREADS_ENV, "").strip()
    if env.isdigit() and int(env) > 0:
        return ThreadChoice(int(env), f"${THREADS_ENV}")
    usable = usable_cpus()
    busy = busy_elsewhere() if busy is None else busy
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity else (os.cpu_count() or usable)
    free = usable if busy is None else min(usable, int(cpus - busy + 0.5))
    if free >= usable:
        return ThreadChoice(usable, "every usable CPU")
    return ThreadChoice(max(1, free), f"{busy:.1f} of {cpus} CPUs busy with other processes")


def decide_threads(threads: int | None = None) -> int:
    """:func:`choose_threads`' count."""
    return choose_threads(threads).threads


def use_threads(threads: int | ThreadChoice | None = None, *, report: bool = False) -> int:
    """Make torch use ``threads`` (a count, a choice, or None: :func:`choose_threads`'s)
    intra-op threads in the calling thread and in threads started after it; returns the
    number. ``report`` prints it on one line, with why when it is fewer than the usable
    CPUs."""
    import torch

    choice = threads if isinstance(threads, ThreadChoice) else choose_threads(threads)
    n = choice.threads
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if report:
        usable = usable_cpus()
        line = f"torch: {n} intra-op thread(s), {usable} CPUs usable"
        if n < usable and choice.why != "given":
            line += (
                f" ({choice.why}; compute.threads or ${THREADS_ENV} sets it: the run's only "
                "big job may use every CPU)"
            )
        print(line, flush=True)
    return n
