"""torch intra-op threads under CPU contention: the demo's warm-up steps with and without a hog.

Runs ``supervised_warmup`` steps of ``make demo``'s warm-up (the same tiny Qwen2, 128 hidden,
2 layers; batches of 32 calculator transcripts; AdamW) with torch's own default thread count
(one per core: the setting before VoltRL chose one) and with VoltRL's default
(``decide_threads()``), each alone and next to a busy-loop subprocess per ``--hogs``. The
settings take turns in each repeat; the table shows the median seconds per step over the
repeats (the first step of each run is not timed) and the 1-minute load average around each
measurement, and the ratios compare the settings measured in this run.

    .venv/bin/python benchmarks/threads_bench.py [--steps 20] [--repeats 3] [--hogs 1]
        [--threads 1 2]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

DEFAULT_TORCH_THREADS = torch.get_num_threads()  # read before anything sets it

from voltrl.algorithms.local.supervised import supervised_warmup  # noqa: E402
from voltrl.models.threads import decide_threads, usable_cpus  # noqa: E402
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "samples" / "calculator"))
from data import make_tasks, warmup_conversations  # noqa: E402

MODEL = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2}  # as samples/calculator/demo.py
BATCH, LR = 32, 2e-3


@contextmanager
def hogs(n: int) -> Iterator[None]:
    """``n`` busy-loop processes for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def seconds_per_step(threads: int, steps: int, conversations: list, tokenizer: object) -> float:
    """Median wall-clock seconds of ``steps`` warm-up steps (after one untimed step)."""
    model = build_tiny_model(tokenizer, seed=0, **MODEL)
    marks: list[float] = []
    supervised_warmup(
        model,
        tokenizer,
        conversations,
        steps=steps + 1,
        batch_size=BATCH,
        lr=LR,
        threads=threads,
        log=lambda step, loss: marks.append(time.perf_counter()),
    )
    return statistics.median(b - a for a, b in itertools.pairwise(marks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hogs", type=int, default=1, help="busy-loop processes when loaded")
    parser.add_argument("--threads", type=int, nargs="*", default=[], help="more settings")
    args = parser.parse_args()

    new = decide_threads()
    settings = {f"torch default ({DEFAULT_TORCH_THREADS})": DEFAULT_TORCH_THREADS}
    settings[f"voltrl default ({new})"] = new
    settings.update({f"threads={n}": n for n in args.threads})
    tokenizer = build_tiny_tokenizer()
    tasks = make_tasks(512, seed=10_000)
    conversations = warmup_conversations(tasks, seed=0, p_tool=0.5)
    print(
        f"{usable_cpus()} usable CPUs, torch {torch.__version__}, {args.steps} steps x "
        f"{args.repeats} repeats, {args.hogs} hog(s) when loaded, "
        f"load average at start {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    times: dict[tuple[str, int], list[float]] = {}
    loads: dict[tuple[str, int], list[float]] = {}
    for repeat in range(args.repeats):
        for n_hogs in (0, args.hogs):
            with hogs(n_hogs):
                for name, threads in settings.items():
                    before = os.getloadavg()[0]
                    s = seconds_per_step(threads, args.steps, conversations, tokenizer)
                    times.setdefault((name, n_hogs), []).append(s)
                    loads.setdefault((name, n_hogs), []).extend([before, os.getloadavg()[0]])
                    print(
                        f"  repeat {repeat + 1}: {name:>20}  hogs {n_hogs}  {s * 1000:7.1f} ms/step"
                        f"  load {before:.2f} -> {os.getloadavg()[0]:.2f}",
                        flush=True,
                    )
    median = {k: statistics.median(v) for k, v in times.items()}
    print("\n| setting | hogs | ms/step (median) | load average (1 min) |")
    print("|---|---:|---:|---|")
    for (name, n_hogs), s in median.items():
        lo, hi = min(loads[name, n_hogs]), max(loads[name, n_hogs])
        print(f"| {name} | {n_hogs} | {s * 1000:.1f} | {lo:.2f} to {hi:.2f} |")
    old, ours = next(iter(settings)), list(settings)[1]
    print()
    for name in settings:
        print(f"{name}: {median[name, args.hogs] / median[name, 0]:.2f}x slower with the hog(s)")
    for n_hogs in (args.hogs, 0):
        ratio = median[old, n_hogs] / median[ours, n_hogs]
        print(f"{n_hogs} hog(s): {ours} is {ratio:.2f}x as fast as {old}")


if __name__ == "__main__":
    main()
