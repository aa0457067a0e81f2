"""The reasoning split's cost: a recorded call through the gateway with ``reasoning_split`` on
vs off, against the fake backend answering like a reasoning model (``<think>...</think>`` then
the answer), whole and streamed, at concurrency 1 and 16, all in one run.

Prints p50 latency, calls/s and the gateway process's CPU time per call of each, the latency
the split adds and the ratios (split on / split off; CPU time is the steadier measure on a busy
machine), and checks that the split was made (the client got ``reasoning_content``). The fake
backend streams one chunk per character (~110 chunks per reply), each one split.

    .venv/bin/python benchmarks/reasoning_split_bench.py [--duration 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_bench import (
    REQUEST_BODY,
    BackendProcess,
    GatewayProcess,
    cpu_s,
    load,
    run,
    stop,
)


def split_was_made(gateway: GatewayProcess) -> bool:
    """One call through ``gateway``: did the client get ``reasoning_content``?"""
    request = urllib.request.Request(
        gateway.urls(1)[0],
        data=json.dumps(REQUEST_BODY).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        message = json.loads(r.read())["choices"][0]["message"]
    return bool(message.get("reasoning_content"))


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    levels = [int(x) for x in args.concurrency.split(",")]
    backend = BackendProcess("--think")
    off = GatewayProcess(backend.url, max(levels))
    on = GatewayProcess(backend.url, max(levels), "--reasoning-split")
    result: dict[str, Any] = {"split_made": {"off": split_was_made(off), "on": split_was_made(on)}}
    try:
        for stream in (False, True):
            body = {**REQUEST_BODY, "stream": stream}
            for c in levels:
                # alternate, so a busy moment of the machine hits both alike
                runs = {}
                for name, gateway in (("off", off), ("on", on)):
                    before = cpu_s(gateway.proc.pid)
                    runs[name] = await load(gateway.urls(c), args.duration, args.warmup, body)
                    calls = runs[name]["sent"] - runs[name]["errors"]
                    runs[name]["cpu_us"] = (cpu_s(gateway.proc.pid) - before) / calls * 1e6
                result[f"{'stream' if stream else 'whole'} c={c}"] = runs
    finally:
        for proc in (on.proc, off.proc, backend.proc):
            stop(proc)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--duration", type=float, default=3.0, help="measured seconds per point")
    ap.add_argument("--warmup", type=float, default=0.5)
    result = run(bench(ap.parse_args()))
    made = result.pop("split_made")
    print(f"split made: off {made['off']}, on {made['on']} (reasoning_content in the reply)")
    print(f"{'case':>14} {'off p50 ms':>11} {'on p50 ms':>10} {'added ms':>9} {'p50 x':>6} "
          f"{'calls/s x':>9} {'off cpu us':>10} {'on cpu us':>9} {'cpu x':>6}")  # fmt: skip
    for case, r in result.items():
        a, b = r["off"], r["on"]
        print(
            f"{case:>14} {a['p50_ms']:>11.3f} {b['p50_ms']:>10.3f} "
            f"{b['p50_ms'] - a['p50_ms']:>+9.3f} {b['p50_ms'] / a['p50_ms']:>6.2f} "
            f"{b['calls_per_s'] / max(a['calls_per_s'], 1e-9):>9.2f} "
            f"{a['cpu_us']:>10.0f} {b['cpu_us']:>9.0f} {b['cpu_us'] / a['cpu_us']:>6.2f}"
        )


if __name__ == "__main__":
    main()
