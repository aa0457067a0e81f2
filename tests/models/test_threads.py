"""torch's intra-op thread count: decided in one place, applied where torch runs, reported.

How much the count matters under contention is measured by ``benchmarks/threads_bench.py``,
not here."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import TESTS
from local_rl_setup import make_algorithm
from rl_agents import ROWS, two_turn_agent
from tiny_batches import tiny_model, varied_batch

import voltrl as vl
from voltrl.algorithms.local.supervised import supervised_warmup
from voltrl.algorithms.local.update import PolicyTrainer
from voltrl.cli import build_from_config
from voltrl.models import threads as threads_module
from voltrl.models.threads import (
    ThreadChoice,
    choose_threads,
    cpu_ticks,
    decide_threads,
    usable_cpus,
    use_threads,
)
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.serving.engine import Engine, SamplingParams
from voltrl.serving.engine import core as engine_module
from voltrl.store.sql import SQLStore


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    """Start each test from 2 threads (not what the tests set) and restore the count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_threads_are_given_then_from_the_environment_then_the_cpus_others_leave(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads_module, "usable_cpus", lambda: 2)
    monkeypatch.setattr(threads_module.os, "sched_getaffinity", lambda pid: {0, 1})
    # the run is the only big job: every CPU; a process busy on one core: the other one
    assert choose_threads(busy=0.2) == ThreadChoice(2, "every usable CPU")
    assert choose_threads(busy=1.0) == ThreadChoice(1, "1.0 of 2 CPUs busy with other processes")
    assert choose_threads(busy=2.0).threads == 1  # at least one
    assert choose_threads(busy=0.5).threads == 2 and choose_threads(busy=1.5).threads == 1
    assert choose_threads(3, busy=2.0) == ThreadChoice(3, "given")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert choose_threads(busy=0.0) == ThreadChoice(5, "$OMP_NUM_THREADS")
    assert decide_threads(2) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    assert choose_threads(busy=1.0).threads == 1
    with pytest.raises(ValueError, match="at least 1"):
        decide_threads(0)


def test_a_machine_with_free_cpus_beyond_a_containers_quota_gives_the_quota(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads_module, "usable_cpus", lambda: 2)
    # 64 CPUs in its mask, 30 kept busy by other containers; its quota allows 2
    monkeypatch.setattr(threads_module.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert choose_threads(busy=30.0).threads == 2


def test_the_cpu_time_of_the_runs_own_processes_is_not_counted_as_busy_elsewhere():
    """A worker process the run starts burns CPU: it is the run's, so it does not lower the
    count (the measure subtracts this process's and its descendants' time)."""
    burn = (
        "import os, sys\n"
        "while sum(os.times()[:2]) < 0.3: pass\n"  # 0.3 s of CPU, then wait
        "print('done', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "done\n"
        fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
        child_ticks = int(fields[11]) + int(fields[12])
        ticks = cpu_ticks()
        assert ticks is not None and child_ticks >= 0.3 * os.sysconf("SC_CLK_TCK") - 1
        assert ticks[1] >= child_ticks  # counted as the run's own
    finally:
        child.kill()
        child.wait()


def test_use_threads_sets_and_reports_why_when_fewer_than_the_cpus(capsys):
    assert use_threads(1, report=True) == 1 and torch.get_num_threads() == 1
    assert capsys.readouterr().out == f"torch: 1 intra-op thread(s), {usable_cpus()} CPUs usable\n"
    busy = ThreadChoice(1, "1.0 of 2 CPUs busy with other processes")
    use_threads(busy, report=True)
    out = capsys.readouterr().out
    if usable_cpus() > 1:
        assert "(1.0 of 2 CPUs busy with other processes; compute.threads or" in out


def test_supervised_warmup_runs_with_its_threads():
    tok = build_tiny_tokenizer()
    conversation = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    }
    supervised_warmup(build_tiny_model(tok), tok, [conversation], steps=1, batch_size=1, threads=1)
    assert torch.get_num_threads() == 1


def test_policy_update_applies_its_threads_in_the_calling_thread():
    """A worker thread that already ran torch keeps its own count; ``step`` sets it there."""
    trainer = PolicyTrainer(tiny_model(), threads=1)
    seen: list[int] = []

    def worker() -> None:
        torch.ones(64, 64) @ torch.ones(64, 64)  # this thread now has 2 threads of its own
        trainer.step(varied_batch())
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [1]
    assert PolicyTrainer(tiny_model()).threads == 2  # default: the creating thread's count


def test_engine_thread_applies_its_threads(monkeypatch):
    applied: list[tuple[str, int | None]] = []

    def record(threads: int | None = None, *, report: bool = False) -> int:
        applied.append((threading.current_thread().name, threads))
        return 1

    monkeypatch.setattr(engine_module, "use_threads", record)
    tok = build_tiny_tokenizer()
    with Engine(build_tiny_model(tok), tok, threads=1) as engine:
        asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_tokens=2)))
    assert applied == [("voltrl-engine", 1)]
    assert Engine(build_tiny_model(tok), tok).threads == 2


def test_local_rl_applies_records_and_reports_its_threads(tmp_path: Path, capsys):
    algo = make_algorithm(schedule={"steps": 0}, compute={"threads": 1})
    assert algo.config()["compute"]["threads"] == 1
    assert make_algorithm().config()["compute"]["threads"] is None  # decided at the start
    vl.Trainer(algo, n_runners=1, inline=True, run_dir=tmp_path, name="t").fit(two_turn_agent, ROWS)
    assert capsys.readouterr().out.count("torch: 1 intra-op thread(s)") == 1
    assert torch.get_num_threads() == 1
    assert algo._engine is not None and algo._engine.threads == 1
    assert algo._policies[None].threads == 1

    async def runs() -> list[vl.Run]:
        store = SQLStore(tmp_path / "t" / "store.sqlite")
        try:
            return await store.list_runs()
        finally:
            await store.close()

    assert [r.config["compute"]["threads"] for r in asyncio.run(runs())] == [1]


def test_threads_come_from_the_yaml_config(tmp_path: Path):
    config = {
        "agent": f"{TESTS / 'rl_agents.py'}:two_turn_agent",
        "data": {"train": str(tmp_path / "train.jsonl")},
        "algorithm": {"name": "local_rl", "model": "unused", "compute": {"threads": 1}},
    }
    (tmp_path / "train.jsonl").write_text('{"x": 1}\n')  # voltrl train checks it exists
    trainer, *_ = build_from_config(config)
    assert trainer.algorithm.threads.threads == 1


def test_a_container_cpu_quota_bounds_the_usable_cpus(tmp_path):
    from voltrl.models.threads import cgroup_cpu_quota

    cpu_max = tmp_path / "cpu.max"
    for text, expected in [("200000 100000\n", 2), ("50000 100000\n", 1), ("max 100000\n", None)]:
        cpu_max.write_text(text)
        assert cgroup_cpu_quota(cpu_max) == expected
    assert cgroup_cpu_quota(tmp_path / "missing") is None
