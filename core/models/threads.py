"""How many intra-op threads torch uses for LocalRL, its engine and the supervised warm-up.

torch's own default is one thread per core. When another process keeps one of those cores
busy, every parallel kernel waits at its barrier for the thread that was descheduled, and a
step gets several times slower (``benchmarks/threads_bench.py``: 2 threads on 2 busy cores
were 3-8x slower than 1). The default here, half the CPUs this process may use (at least 1), leaves
room for the agent's runner processes, the engine thread and the rest of the machine.

:func:`decide_threads` is the one place that picks the number; :func:`use_threads` applies it.
torch keeps the setting per thread once a thread has run a parallel kernel, so code that runs
torch on a thread of its own (the engine, the policy update) applies it there again.
"""

from __future__ import annotations

import os
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


def decide_threads(threads: int | None = None) -> int:
    """The intra-op thread count to use: ``threads`` when given, else ``$OMP_NUM_THREADS``
    when it is a positive integer, else half of :func:`usable_cpus` (at least 1)."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        return threads
    env = os.environ.get(THREADS_ENV, "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, usable_cpus() // 2)


def use_threads(threads: int | None = None, *, report: bool = False) -> int:
    """Make torch use :func:`decide_threads` intra-op threads in the calling thread and in
    threads started after it; returns the number. ``report`` prints it on one line."""
    import torch

    n = decide_threads(threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if report:
        print(f"torch: {n} intra-op thread(s), {usable_cpus()} CPUs usable", flush=True)
    return n
