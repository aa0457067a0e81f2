"""Our store against the peer's (agentlightning 0.3.0) in the peer harness, in one invocation.

The harness ``shared/bench/peer/store_throughput.py`` is used as is (read-only, not copied):
each run is one harness process, the peer's in its own venv (``--peer-python``), ours with
``benchmarks/peer_store.py``'s ``OursStoreAdapter`` registered in the harness's ``ADAPTERS``.
Both run the same lifecycle (enqueue -> claim -> 10 spans -> complete with a reward) over HTTP
with N concurrent workers, the store server in its own process, one after the other on the
same machine, so the ratio is measured under the same conditions::

    python3 -m venv .venv-peer && .venv-peer/bin/pip install agentlightning==0.3.0
    .venv/bin/python benchmarks/run_peer_store.py --peer-python .venv-peer/bin/python

prints rollouts/s per N and the ratio ours/peer (against the peer's best configuration at that
N), the server's RSS before and after and its growth per 1,000 rollouts, and then a memory
check: our server's RSS sampled every 1,000 rollouts over ``--memory-rollouts`` rollouts.

``harness ARGS...`` runs the harness itself with our adapter registered (what the comparison
runs for ours), e.g. ``run_peer_store.py harness --impl ours --mode inproc``.
Set ``VOLTRL_PEER_BENCH`` to use another harness directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peer_store import PEER, memory_check  # noqa: E402

PEER_CONFIGS = {
    "native": ["--agl-client", "native", "--agl-spans", "rest"],
    "raw": ["--agl-client", "raw", "--agl-spans", "rest"],
    "otlp": ["--agl-client", "native", "--agl-spans", "otlp"],
}
"""The peer's client configurations: its runner's client, bare aiohttp, spans over OTLP."""


def run_harness_here(argv: list[str]) -> None:
    """Run the harness's command line in this process, with our adapter registered."""
    sys.path.insert(0, str(PEER))
    import store_throughput
    from peer_store import OursStoreAdapter

    store_throughput.OursStoreAdapter = OursStoreAdapter
    store_throughput.ADAPTERS["ours"] = OursStoreAdapter
    sys.argv = [str(PEER / "store_throughput.py"), *argv]
    store_throughput.main()


def run_once(
    python: str, argv: list[str], label: str, out: Path, deadline: float, env: dict[str, str]
) -> dict:
    """One harness process; returns its JSON result (or an ``error``)."""
    json_out = out / f"{label}.json"
    cmd = [python, *argv, "--json-out", str(json_out), "--deadline", str(deadline)]
    print(f"[{time.strftime('%H:%M:%S')}] {label}: {' '.join(cmd)}", flush=True)
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=deadline + 30, check=False,
        env={**os.environ, **env},
    )  # fmt: skip
    if done.returncode != 0 or not json_out.exists():
        tail = (done.stderr or done.stdout)[-1500:]
        print(f"  {label} failed (exit {done.returncode}):\n{tail}", flush=True)
        return {"error": tail}
    return json.loads(json_out.read_text())


def created(level: dict) -> int:
    """Rollouts the server holds at the end of a level that it did not hold at its start."""
    before, after = level.get("server_before", {}), level.get("server_after", {})
    return (after.get("total_rollouts") or 0) - (before.get("total_rollouts") or 0)


def growth_per_1000(level: dict) -> float | None:
    """Server RSS growth over a level, in MiB per 1,000 rollouts created in it."""
    before, after = level.get("server_before", {}), level.get("server_after", {})
    if not created(level) or "rss_mib" not in before or "rss_mib" not in after:
        return None
    return (after["rss_mib"] - before["rss_mib"]) / created(level) * 1000


def cpu_ms_per_rollout(level: dict, key: str) -> float | None:
    """CPU milliseconds per rollout created in a level: the server's or the harness's."""
    cpu = level.get(key)
    return None if cpu is None or not created(level) else cpu / created(level) * 1000


def print_table(results: dict[str, list[dict]]) -> None:
    """Rollouts/s per N for every configuration, and ours over the best peer configuration."""
    levels = sorted(
        {lv["concurrency"] for runs in results.values() for r in runs for lv in r.get("levels", [])}
    )

    def rate(name: str, n: int) -> float | None:
        vals = [
            lv["rollouts_per_s"]
            for r in results[name]
            for lv in r.get("levels", [])
            if lv["concurrency"] == n
        ]
        return sorted(vals)[len(vals) // 2] if vals else None  # median over repeats

    names = list(results)
    peers = [n for n in names if n.startswith("peer")]  # the ratio is of "ours"
    print("\ncompleted rollouts/s (median over repeats)")
    print(f"{'N':>4} " + " ".join(f"{n:>14}" for n in names) + f" {'ours/best peer':>15}")
    for n in levels:
        row = {name: rate(name, n) for name in names}
        best = max((row[p] for p in peers if row[p]), default=None)
        ratio = f"{row['ours'] / best:14.1f}x" if best and row.get("ours") else f"{'-':>15}"
        cells = " ".join(f"{v:>14.1f}" if v is not None else f"{'-':>14}" for v in row.values())
        print(f"{n:>4} {cells} {ratio}")

    print(
        "\nserver RSS (MiB), CPU ms per rollout and errors, per configuration and N (first repeat)"
    )
    header = f"{'config':>14} {'N':>4} {'RSS before':>10} {'after':>8} {'MiB/1k rollouts':>16}"
    print(f"{header} {'server CPU':>10} {'client CPU':>10} {'errors':>7}")
    for name in names:
        first = results[name][0] if results[name] else {}
        for lv in first.get("levels", []):
            g = growth_per_1000(lv)
            before = lv.get("server_before", {}).get("rss_mib")
            after = lv.get("server_after", {}).get("rss_mib")
            errors = lv.get("failed_lifecycles", 0) + sum(lv.get("errors", {}).values())
            cpu = [cpu_ms_per_rollout(lv, k) for k in ("server_cpu_s", "harness_cpu_s")]
            print(
                f"{name:>14} {lv['concurrency']:>4} {before or '-':>10} {after or '-':>8} "
                f"{'-' if g is None else f'{g:.1f}':>16} "
                + " ".join(f"{'-' if c is None else f'{c:.2f}':>10}" for c in cpu)
                + f" {errors:>7}"
            )


def main() -> None:
    """Parse flags, run the peer and ours in turn, print the tables and the memory check."""
    if len(sys.argv) > 1 and sys.argv[1] == "harness":
        run_harness_here(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-python", default=None, help="python of a venv with agentlightning")
    parser.add_argument("--peer-configs", default="native,raw", help=f"of {sorted(PEER_CONFIGS)}")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--duration", type=float, default=6.0, help="measured seconds per level")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--memory-rollouts", type=int, default=20000, help="0: no memory check")
    parser.add_argument("--json-out", default=None, help="write every raw result here")
    parser.add_argument(
        "--also-plain",
        action="store_true",
        help="also run ours on h11 and asyncio's loop (no httptools, no uvloop), for reference",
    )
    args = parser.parse_args()
    if not (PEER / "store_throughput.py").exists():
        sys.exit(f"peer harness not found at {PEER} (set VOLTRL_PEER_BENCH)")

    common = ["--mode", "http", "--concurrency", args.concurrency]
    common += ["--duration", str(args.duration), "--warmup", str(args.warmup)]
    deadline = 60 + 3 * len(args.concurrency.split(",")) * (args.duration + args.warmup + 5)
    runs: list[tuple[str, str, list[str], dict[str, str]]] = []
    if args.peer_python:
        for config in args.peer_configs.split(","):
            argv = [str(PEER / "store_throughput.py"), "--impl", "agentlightning"]
            argv += common + PEER_CONFIGS[config]
            runs.append((f"peer-{config}", args.peer_python, argv, {}))
    ours = [str(Path(__file__).resolve()), "harness", "--impl", "ours", *common]
    runs.append(("ours", sys.executable, ours, {}))
    if args.also_plain:
        runs.append(("ours-plain", sys.executable, ours, {"VOLTRL_PEER_PLAIN": "1"}))

    results: dict[str, list[dict]] = {name: [] for name, _, _, _ in runs}
    with tempfile.TemporaryDirectory(prefix="voltrl-peer-store-") as tmp:
        for i in range(args.repeats):
            order = runs if i % 2 == 0 else runs[::-1]  # alternate, so drift hits both sides
            for name, python, argv, env in order:
                res = run_once(python, argv, f"{name}-{i}", Path(tmp), deadline, env)
                results[name].append(res)
    print_table(results)
    memory: list[tuple[int, float]] = []
    if args.memory_rollouts:
        print(f"\nmemory check: {args.memory_rollouts} rollouts, 32 workers, our server")
        t0 = time.perf_counter()
        memory = asyncio.run(memory_check(args.memory_rollouts, 32, 1000))
        print(f"{args.memory_rollouts} rollouts in {time.perf_counter() - t0:.1f} s")
        print(f"{'rollouts':>9} {'server RSS MiB':>15}")
        for n, rss in memory:
            print(f"{n:>9} {rss:>15.1f}")
    if args.json_out:
        out: dict[str, Any] = {"results": results, "memory": memory, "argv": sys.argv}
        Path(args.json_out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
