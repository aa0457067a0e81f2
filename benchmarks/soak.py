"""Soak: LocalRL on the tiny model for hundreds of steps, with a fault every few steps.

A long run is where the holes show: a call nobody waits for that stalls every weight swap,
checkpoints that fill the disk, memory or file descriptors that creep up, a rollout lost or
trained twice across a restart. This script runs one LocalRL run (the tiny model, two runner
processes, the store in a ``voltrl serve`` process) and injects, in turn, every ``--fault-every``
steps: a runner worker SIGKILLed, the store server restarted, the trainer SIGTERMed and
resumed, and a full disk on one checkpoint (the run fails, then resumes once there is space).
Three faults run throughout: an agent that hangs past the rollout timeout on one task, an agent
whose client gives up mid-call on another (a 3,000-token generation the gateway must cut off),
and a tracker that blocks for 10 seconds on every 20th metrics line.

At the end it prints, and exits 1 unless they hold: rollouts lost (left queued or running):
0; rollouts trained twice: 0; steps completed; the trainer's RSS, open fds and threads at the
start and end of every 50 steps; the disk the checkpoints use (bounded by
``keep_checkpoints``); the longest weight swap (bounded by the gateway's pause deadline); and
the step time over the run, per 50 steps.

    .venv/bin/python benchmarks/soak.py                           # 200 steps, about 15 min
    .venv/bin/python benchmarks/soak.py --steps 12 --fault-every 2  # the short one make test runs

The trainer runs as this script with ``--trainer`` (one process per start; a resume is a new
one), which also records what each update trained and how long each weight swap took.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import errno
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar, Literal

ROOT = Path(__file__).resolve().parents[1]
RUN = "soak"
CHECKPOINT_EVERY = 5
KEEP_CHECKPOINTS = 3
ROLLOUT_TIMEOUT_S = 4.0
DRIVER_FAULTS = ("kill_worker", "restart_store", "sigterm_trainer", "full_disk")


# ---- the trainer process -------------------------------------------------------------------
async def soak_agent(task: dict[str, Any], llm: Any, ctx: Any) -> float:
    """Two chat calls that pass no sampling (the gateway fills the run's). Its first attempt
    at a ``hang`` task sleeps past the rollout timeout; its first call of a ``disconnect``
    task asks for 3,000 tokens and gives up after 0.3 s."""
    import openai

    marker = Path(task["markers"]) / ctx.rollout_id
    first = not marker.exists()
    marker.touch()
    if task["fault"] == "hang" and first:
        await asyncio.sleep(60)  # cancelled by the runner at the rollout timeout
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    messages = [{"role": "user", "content": f"Say {task['letter']}."}]
    if task["fault"] == "disconnect" and first:
        # the client gives up after 0.3 s; the gateway cuts the generation off
        with contextlib.suppress(openai.APITimeoutError):
            await client.with_options(timeout=0.3).chat.completions.create(
                model=llm.model,
                messages=messages,
                max_tokens=3000,
                extra_body={"ignore_eos": True},
            )
    reply = await client.chat.completions.create(model=llm.model, messages=messages)
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content or ""},
        {"role": "user", "content": "Again."},
    ]
    again = await client.chat.completions.create(model=llm.model, messages=messages)
    return float(task["letter"] in (again.choices[0].message.content or ""))


def trainer_main(args: argparse.Namespace) -> int:
    """One trainer process: the run (resumed when it exists) with the soak's instruments."""
    import voltrl as vl
    import voltrl.algorithms.local.algorithm as local_algorithm
    import voltrl.algorithms.local.checkpoints as checkpoints_module
    from voltrl.observability.trackers import Logger

    class SlowTracker(Logger):
        """A tracker that blocks for 10 s on every 20th metrics line."""

        name: Literal["soak-slow"] = "soak-slow"
        seen: ClassVar[list[int]] = []

        def log_metrics(self, step: int, metrics: Any) -> None:
            self.seen.append(step)
            if len(self.seen) % 20 == 0:
                time.sleep(10)

    soak = Path(args.dir)
    if args.full_disk_at is not None:  # the disk fills while this checkpoint is written
        write, doomed = checkpoints_module.durable_save, f".tmp-step_{args.full_disk_at:08d}"

        def full_disk(obj: Any, path: Path) -> None:
            if path.parent.name == doomed and path.name == "optimizer.pt":
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            write(obj, path)

        checkpoints_module.durable_save = full_disk
    update, serve = local_algorithm.LocalRL._update, local_algorithm.LocalRL._serve_new_weights

    def recorded_update(self: Any, parts: Any, step: int) -> Any:
        out = update(self, parts, step)
        ids = sorted({rid for part in parts.values() for rid in part.rollout_ids})
        _append(soak / "trained.jsonl", {"step": step + 1, "rollouts": ids})
        return out

    async def timed_swap(self: Any, ctx: Any, trained: Any) -> None:
        start = time.perf_counter()
        await serve(self, ctx, trained)
        _append(soak / "swaps.jsonl", {"seconds": time.perf_counter() - start})

    local_algorithm.LocalRL._update = recorded_update
    local_algorithm.LocalRL._serve_new_weights = timed_swap
    markers = soak / "markers"
    markers.mkdir(exist_ok=True)
    faults = {0: "hang", 5: "disconnect"}
    tasks = [
        {"letter": c, "fault": faults.get(i), "markers": str(markers)}
        for i, c in enumerate("abcdefgh")
    ]
    algo = vl.LocalRL(
        "tiny",
        schedule={"steps": args.steps, "tasks_per_step": 2, "group_size": 2},
        compute={"threads": 1},
        checkpoints={"every": CHECKPOINT_EVERY, "keep": KEEP_CHECKPOINTS, "resume": True},
        sampling={"max_tokens": 8},
        update={"lr": 1e-4, "micro_batch_size": 4},
    )
    trainer = vl.Trainer(
        algo,
        n_runners=2,
        max_concurrency=4,
        store=args.store,
        run_dir=soak / "runs",
        name=RUN,
        rollout_timeout_s=ROLLOUT_TIMEOUT_S,
        loggers=[SlowTracker()],
        progress=False,
    )
    try:
        trainer.fit(vl.rollout(soak_agent), tasks)
    except vl.VoltRLError as exc:
        print(f"trainer: {exc}", flush=True)
        return 1
    return 0


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ---- the driver ----------------------------------------------------------------------------
class Soak:
    """The store server, the trainer process, the faults, and what was measured."""

    def __init__(self, folder: Path, steps: int, fault_every: int) -> None:
        self.dir, self.steps, self.fault_every = folder, steps, fault_every
        self.token = secrets.token_hex(16)
        self.env = {**os.environ, "VOLTRL_TOKEN": self.token, "PYTHONUNBUFFERED": "1"}
        self.port = _free_port()
        self.store: subprocess.Popen[bytes] | None = None
        self.trainer: subprocess.Popen[bytes] | None = None
        self.faults: collections.Counter[str] = collections.Counter()
        self.samples: list[tuple[int, int, float, int, int]] = []  # step, pid, MB, fds, threads
        self.max_checkpoint_mb = 0.0
        self.expect_exit: str | None = None  # why the trainer is about to end

    @property
    def run_dir(self) -> Path:
        return self.dir / "runs" / RUN

    def start_store(self) -> None:
        log = open(self.dir / "store.log", "ab")  # noqa: SIM115 - the process keeps it
        self.store = subprocess.Popen(
            [
                *(sys.executable, "-m", "voltrl.cli", "serve", "--no-gateway"),
                *("--store", str(self.dir / "store.sqlite"), "--port", str(self.port)),
            ],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        _wait_for_port(self.port, 60)

    def start_trainer(self, full_disk_at: int | None = None) -> None:
        args = [sys.executable, __file__, "--trainer", "--dir", str(self.dir)]
        args += ["--steps", str(self.steps), "--store", f"http://127.0.0.1:{self.port}"]
        if full_disk_at is not None:
            args += ["--full-disk-at", str(full_disk_at)]
        log = open(self.dir / "trainer.log", "ab")  # noqa: SIM115 - the process keeps it
        self.trainer = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def steps_done(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return 0
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        return max((int(x["step"]) for x in lines if "update_s" in x), default=0)

    def sample(self, step: int) -> None:
        assert self.trainer is not None
        pid = self.trainer.pid
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            return
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss_mb = int(fields["VmRSS"].split()[0]) / 1024
        self.samples.append((step, pid, rss_mb, fds, int(fields["Threads"])))

    def fault(self, kind: str, step: int) -> None:
        assert self.trainer is not None and self.store is not None
        self.faults[kind] += 1
        print(f"step {step}: {kind.replace('_', ' ')}", flush=True)
        if kind == "kill_worker":
            workers = _children(self.trainer.pid)
            if workers:
                os.kill(workers[0], signal.SIGKILL)
        elif kind == "restart_store":
            self.store.terminate()
            self.store.wait(60)
            self.start_store()
        elif kind == "sigterm_trainer":
            self.expect_exit = kind
            self.trainer.send_signal(signal.SIGTERM)
        elif kind == "full_disk":  # the trainer restarts, and its next checkpoint fails
            self.expect_exit = kind
            at = (step // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY
            if at > self.steps:
                self.faults[kind] -= 1
                self.expect_exit = None
                return
            self.trainer.send_signal(signal.SIGTERM)
            self.trainer.wait(300)
            self.start_trainer(full_disk_at=at)

    def run(self) -> int:
        """Drive the run to its last step through the faults; returns the wall seconds."""
        self.start_store()
        self.start_trainer()
        started = time.monotonic()
        next_fault, turn, last = self.fault_every, 0, -1
        while True:
            assert self.trainer is not None
            step = self.steps_done()
            if step != last:
                if step <= 1 or step % 50 in (0, 1) or step == self.steps:
                    self.sample(step)
                self.max_checkpoint_mb = max(self.max_checkpoint_mb, self.checkpoint_mb())
                last = step
            code = self.trainer.poll()
            if code is not None:
                if code == 0 and step >= self.steps:
                    break
                if self.expect_exit is None and code != 0:
                    raise RuntimeError(f"the trainer exited {code}: see {self.dir}/trainer.log")
                print(f"step {step}: the trainer exited {code}; resuming", flush=True)
                self.expect_exit = None
                self.start_trainer()
                continue
            if step >= next_fault and self.expect_exit is None and step < self.steps:
                self.fault(DRIVER_FAULTS[turn % len(DRIVER_FAULTS)], step)
                turn, next_fault = turn + 1, step + self.fault_every
            time.sleep(0.2)
        return int(time.monotonic() - started)

    def checkpoint_mb(self) -> float:
        total = 0
        for folder, _, names in os.walk(self.run_dir / "checkpoints"):
            for name in names:
                with contextlib.suppress(FileNotFoundError):  # pruned meanwhile
                    total += os.stat(os.path.join(folder, name)).st_size
        return total / 1e6

    def stop(self) -> None:
        for proc in (self.trainer, self.store):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _children(pid: int) -> list[int]:
    """The runner worker processes of ``pid`` (``python -c`` children)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and cmdline[1:2] == [b"-c"]:
            out.append(int(entry.name))
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_port(port: int, timeout_s: float) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the store server did not listen on port {port}")


async def _stored(path: Path) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """The rollouts by mode and status, and what happened to their attempts and calls:
    attempts by status, calls the gateway cut off by reason."""
    from voltrl.store.sql import SQLStore
    from voltrl.types import ABANDONED_SPAN

    store = SQLStore(path)
    try:
        rollouts = await store.query_rollouts()
        events: collections.Counter[str] = collections.Counter()
        for rollout in rollouts:
            for attempt in await store.get_attempts(rollout.rollout_id):
                events[f"attempt {attempt.status}"] += 1
            for span in await store.get_spans(rollout.rollout_id):
                if span.name == ABANDONED_SPAN:
                    events[f"call cut off: {span.attributes.get('voltrl.cut_reason')}"] += 1
        return collections.Counter(f"{r.mode}/{r.status}" for r in rollouts), events
    finally:
        await store.close()


def report(soak: Soak, seconds: int) -> int:
    """Print what the run shows; 1 when a rollout was lost or trained twice, or the run fell
    short of its steps."""
    statuses, events = asyncio.run(_stored(soak.dir / "store.sqlite"))
    lost = sum(n for key, n in statuses.items() if key.endswith(("/queued", "/running")))
    trained = [json.loads(x) for x in (soak.dir / "trained.jsonl").read_text().splitlines()]
    ids = collections.Counter(rid for record in trained for rid in record["rollouts"])
    twice = sum(1 for n in ids.values() if n > 1)
    redone = sum(n - 1 for n in collections.Counter(r["step"] for r in trained).values() if n > 1)
    swaps = [json.loads(x)["seconds"] for x in (soak.dir / "swaps.jsonl").read_text().splitlines()]
    lines = [json.loads(x) for x in (soak.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = list({x["step"]: x for x in lines if "update_s" in x}.values())  # a redone: its last
    done = soak.steps_done()
    print(f"\nsoak: {done} of {soak.steps} steps in {seconds / 60:.1f} minutes", flush=True)
    print(
        f"faults injected: {dict(soak.faults)}; throughout: an agent hanging past its "
        "timeout, a client giving up mid-call, a tracker blocking 10 s every 20 lines"
    )
    print(f"rollouts: {dict(sorted(statuses.items()))}")
    print(f"attempts and calls: {dict(sorted(events.items()))}")
    print(f"rollouts lost: {lost}")
    print(f"rollouts trained twice: {twice} (of {len(ids)} trained)")
    print(f"steps redone after a failed run resumed from its last checkpoint: {redone}")
    print(f"steps completed: {done}")
    print("trainer process (start and end of every 50 steps):")
    print("   step      pid    RSS MB   fds  threads")
    for step, pid, mb, fds, threads in soak.samples:
        print(f"  {step:5d}  {pid:7d}  {mb:8.1f}  {fds:4d}  {threads:7d}")
    end_mb = soak.checkpoint_mb()
    print(
        f"checkpoints on disk: {end_mb:.1f} MB at the end, at most "
        f"{max(end_mb, soak.max_checkpoint_mb):.1f} MB (keep_checkpoints={KEEP_CHECKPOINTS})"
    )
    print(
        f"weight swaps: {len(swaps)}, longest {max(swaps, default=0):.2f} s, median "
        f"{statistics.median(swaps) if swaps else 0:.2f} s (pause deadline 30 s)"
    )
    print("step time (rollouts + update), median per 50 steps:")
    for start in range(0, len(steps), 50):
        window = [x["rollout_s"] + x["update_s"] for x in steps[start : start + 50]]
        print(f"  steps {start + 1}-{start + len(window)}: {statistics.median(window):.2f} s")
    if not (events["call cut off: client_disconnected"] and events["attempt timeout"]):
        print("soak: the agents' faults did not happen (no call cut off or no timeout)")
    ok = lost == 0 and twice == 0 and done >= soak.steps
    ok = ok and bool(events["call cut off: client_disconnected"] and events["attempt timeout"])
    print("soak: " + ("OK" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fault-every", type=int, default=8, help="steps between faults")
    parser.add_argument("--dir", default=None, help="where the run goes (default: a new one)")
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--full-disk-at", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        return trainer_main(args)
    folder = Path(args.dir or ROOT / "runs" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}")
    folder.mkdir(parents=True, exist_ok=True)
    soak = Soak(folder, args.steps, args.fault_every)
    print(f"soak: {args.steps} steps, a fault every {args.fault_every}, in {folder}", flush=True)
    try:
        seconds = soak.run()
    finally:
        soak.stop()
    return report(soak, seconds)


if __name__ == "__main__":
    sys.exit(main())
