"""Gateway overhead: a recorded call through ``voltrl.gateway`` vs the fake backend called
directly.

One run measures, with a closed-loop aiohttp load generator on loopback:

- ``direct``: client -> fake vLLM-style backend (``tests/fake_openai_backend.py``);
- ``gateway``: client -> gateway (its own process, uvicorn, InMemoryStore) -> the same backend,
  each client slot on its own rollout-scoped URL, so every call is recorded with token ids;

at concurrency 1 and 16 (``--concurrency``), plus the highest calls/s over ``--max-levels``.
It prints p50/p99 latency, calls/s, the latency the gateway adds and the ratios, then checks
that the store holds exactly one LLMCall (with token ids) per successful gateway call, and
prints the gateway process's CPU time per recorded call (steadier than calls/s on a busy
machine).

    .venv/bin/python benchmarks/gateway_bench.py [--duration 4] [--json-out F]

Child mode (used by this script and by ``benchmarks/peer_ours.py``):
``gateway_bench.py --serve-gateway --backend URL --port P --rollouts N`` prints one JSON line
with the rollout ids, then serves; ``GET /bench/stats`` reports what was recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"
REQUEST_BODY = {
    "model": "fake-model",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2? Answer briefly."},
    ],
    "max_tokens": 16,
    "temperature": 0.0,
}


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def wait_http_ok(url: str, proc: subprocess.Popen[Any], timeout_s: float = 30.0) -> None:
    """Poll ``url`` until it answers 200 (or the process dies, or time runs out)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s")


def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    """A child in its own process group, so stop() takes its children with it. Its
    ``PYTHONPATH`` is this checkout's root, then the caller's (which may name the ``voltrl``
    to measure, such as another worktree's)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.PIPE)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def stop(proc: subprocess.Popen[Any]) -> None:
    """Terminate a child started by :func:`spawn` (and its group), killing it if it lingers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class BackendProcess:
    """The fake vLLM-style backend in its own process."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}/v1"
        script = str(ROOT / "tests" / "fake_openai_backend.py")
        self.proc = spawn([sys.executable, script, "--port", str(self.port), *args])
        wait_http_ok(f"http://{LOOPBACK}:{self.port}/health", self.proc)


class GatewayProcess:
    """Our gateway (uvicorn + InMemoryStore) in its own process, with ``n`` running rollouts."""

    def __init__(self, backend_url: str, rollouts: int, *args: str) -> None:
        self.port = free_port()
        self.base = f"http://{LOOPBACK}:{self.port}"
        argv = [sys.executable, __file__, "--serve-gateway", "--backend", backend_url]
        argv += ["--port", str(self.port), "--rollouts", str(rollouts), *args]
        self.proc = spawn(argv)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the gateway process exited before it started")
        self.rollouts: list[tuple[str, str]] = [tuple(x) for x in json.loads(line)["rollouts"]]
        wait_http_ok(f"{self.base}/bench/stats", self.proc)

    def urls(self, n: int) -> list[str]:
        """One rollout-scoped chat-completions URL per client slot."""
        return [
            f"{self.base}/rollouts/{rid}/attempts/{aid}/v1/chat/completions"
            for rid, aid in self.rollouts[:n]
        ]

    def stats(self) -> dict[str, Any]:
        """What the gateway's store holds: calls, calls with token ids, per-rollout counts."""
        with urllib.request.urlopen(f"{self.base}/bench/stats", timeout=30) as r:
            return json.loads(r.read())


# ---- child: serve the gateway ------------------------------------------------------------
def serve_gateway_child(
    backend: str, port: int, n_rollouts: int, reasoning_split: bool = False
) -> None:
    """Run the gateway on 127.0.0.1:port (uvloop and httptools when installed)."""
    import uvicorn

    from voltrl.gateway import Gateway
    from voltrl.store.memory import InMemoryStore
    from voltrl.types import Task

    store = InMemoryStore()
    gateway = Gateway(store, [backend], model="fake-model", reasoning_split=reasoning_split)

    async def setup() -> list[tuple[str, str]]:
        await store.enqueue([Task(input={"i": i}) for i in range(n_rollouts)])
        out = []
        for i in range(n_rollouts):
            claim = await store.claim(f"bench-{i}", lease_s=3600)
            assert claim is not None
            out.append((claim.rollout.rollout_id, claim.attempt.attempt_id))
        return out

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/bench/stats":
            calls = [c for rid, _ in rollouts for c in await store.get_llm_calls(rid)]
            body = json.dumps(
                {
                    "calls": len(calls),
                    "with_token_ids": sum(c.has_token_ids for c in calls),
                    "prompt_ids_len": len(calls[0].prompt_token_ids or []) if calls else 0,
                    "response_ids_len": len(calls[0].response_token_ids or []) if calls else 0,
                    "per_rollout": [len(await store.get_llm_calls(rid)) for rid, _ in rollouts],
                }
            ).encode()
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await gateway(scope, receive, send)

    async def main() -> None:
        config = uvicorn.Config(
            app, host=LOOPBACK, port=port, log_level="warning", access_log=False, lifespan="off"
        )
        server = uvicorn.Server(config)
        await server.serve()
        await gateway.aclose()

    rollouts = run(setup())
    print(json.dumps({"rollouts": rollouts}), flush=True)
    run(main())


def run(coro: Any) -> Any:
    """Run a coroutine on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# ---- load generator ------------------------------------------------------------------------
def percentile(sorted_vals: list[float], q: float) -> float:
    """Linear-interpolated percentile of sorted values."""
    if not sorted_vals:
        return float("nan")
    k = (len(sorted_vals) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


async def load(
    urls: list[str], duration: float, warmup: float, body: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Closed loop: each URL is a client slot that sends the next call as soon as one returns
    (``body``: the request, default :data:`REQUEST_BODY`)."""
    import aiohttp

    payload = json.dumps(body or REQUEST_BODY).encode()
    headers = {"content-type": "application/json"}
    lat: list[float] = []
    errors: list[str] = []
    ok = 0
    t_measure = time.perf_counter() + warmup
    t_stop = t_measure + duration
    connector = aiohttp.TCPConnector(limit=len(urls))
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker(url: str) -> int:
            sent = 0
            nonlocal ok
            while time.perf_counter() < t_stop:
                t0 = time.perf_counter()
                sent += 1
                async with session.post(url, data=payload, headers=headers) as r:
                    body = await r.read()
                t1 = time.perf_counter()
                if r.status != 200:
                    errors.append(f"HTTP {r.status}: {body[:200]!r}")
                elif t_measure <= t1 <= t_stop:
                    lat.append(t1 - t0)
                    ok += 1
            return sent

        sent = sum(await asyncio.gather(*(worker(u) for u in urls)))
    lat.sort()
    return {
        "concurrency": len(urls),
        "calls_per_s": round(ok / duration, 1),
        "p50_ms": round(percentile(lat, 0.5) * 1e3, 3),
        "p99_ms": round(percentile(lat, 0.99) * 1e3, 3),
        "errors": len(errors),
        "error_sample": errors[:1],
        "sent": sent,
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    levels = [int(x) for x in args.concurrency.split(",")]
    max_levels = [int(x) for x in args.max_levels.split(",")]
    n = max(levels + max_levels)
    backend = BackendProcess()
    gateway = GatewayProcess(backend.url, n)
    result: dict[str, Any] = {"levels": {}, "max": {}}
    sent_through_gateway = 0
    cpu_before = cpu_s(gateway.proc.pid)
    try:
        for c in levels:
            direct = await load([f"{backend.url}/chat/completions"] * c, args.duration, args.warmup)
            through = await load(gateway.urls(c), args.duration, args.warmup)
            sent_through_gateway += through["sent"] - through["errors"]
            result["levels"][c] = {"direct": direct, "gateway": through}
        for c in max_levels:
            through = await load(gateway.urls(c), args.duration, args.warmup)
            sent_through_gateway += through["sent"] - through["errors"]
            result["max"][c] = through["calls_per_s"]
        cpu = cpu_s(gateway.proc.pid) - cpu_before
        stats = gateway.stats()
        result["recorded"] = {
            "successful_gateway_calls": sent_through_gateway,
            "llm_calls_in_store": stats["calls"],
            "with_token_ids": stats["with_token_ids"],
            "prompt_ids_len": stats["prompt_ids_len"],
            "response_ids_len": stats["response_ids_len"],
        }
        result["gateway_cpu_us_per_call"] = round(cpu / max(stats["calls"], 1) * 1e6, 1)
    finally:
        stop(gateway.proc)
        stop(backend.proc)
    return result


def report(result: dict[str, Any]) -> None:
    """Print the table and ratios."""
    print(f"{'conc':>4} {'variant':>8} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}")
    for c, lv in result["levels"].items():
        for name in ("direct", "gateway"):
            r = lv[name]
            print(
                f"{c:>4} {name:>8} {r['calls_per_s']:>9} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} "
                f"{r['errors']:>6}"
            )
        d, g = lv["direct"], lv["gateway"]
        added50, added99 = g["p50_ms"] - d["p50_ms"], g["p99_ms"] - d["p99_ms"]
        lat_ratio, tput_ratio = g["p50_ms"] / d["p50_ms"], g["calls_per_s"] / d["calls_per_s"]
        print(
            f"     added p50 {added50:+.3f} ms, p99 {added99:+.3f} ms; "
            f"p50 ratio {lat_ratio:.2f}x; calls/s ratio {tput_ratio:.2f}x of direct"
        )
    best = max(result["max"].items(), key=lambda kv: kv[1])
    print(f"max recorded calls/s: {best[1]} (concurrency {best[0]}); all levels {result['max']}")
    rec = result["recorded"]
    print(
        f"recorded: {rec['llm_calls_in_store']} LLMCalls for {rec['successful_gateway_calls']} "
        f"gateway calls, {rec['with_token_ids']} with token ids "
        f"({rec['prompt_ids_len']} prompt / {rec['response_ids_len']} response ids each)"
    )
    print(f"gateway process CPU: {result['gateway_cpu_us_per_call']} us per recorded call")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--max-levels", default="16,32", help="concurrency levels for max calls/s")
    ap.add_argument("--duration", type=float, default=4.0, help="measured seconds per point")
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--serve-gateway", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rollouts", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--reasoning-split", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_gateway:
        serve_gateway_child(args.backend, args.port, args.rollouts, args.reasoning_split)
        return
    result = run(bench(args))
    report(result)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
