"""The store server's own CPU per rollout, without sockets or SQLite: the routing and binding.

Drives ``store_app``'s ASGI callable (with a token, over an ``InMemoryStore``) in this process
through a runner's lifecycle, enqueue -> claim -> complete with 10 spans (~800 bytes of
attributes each), and prints the process CPU time per rollout, the least of ``--repeats`` (the
one least disturbed by other work on the machine). The request bodies are built before the
clock starts, so the figure is the server side only. To compare two trees, run it once per
tree with ``PYTHONPATH`` naming each one's ``voltrl``.

    .venv/bin/python benchmarks/store_asgi_bench.py [--rollouts 1500] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from voltrl.store.http.endpoints import store_app
from voltrl.store.memory import InMemoryStore
from voltrl.types import Span

TOKEN = b"bench-token"
SPAN = Span(
    rollout_id="@RID@",
    attempt_id="@AID@",
    name="openai.chat.completion",
    attributes={f"attr.{i}": "v" * 60 for i in range(12)},
)
REPORT = json.dumps(
    {"status": "succeeded", "reward": 1.0, "spans": [SPAN.model_dump(mode="json")] * 10}
).encode()


async def request(app: Any, path: str, body: bytes) -> bytes:
    """POST ``body`` to ``path`` through the ASGI callable; the answer's body (must be 200)."""
    sent: list[dict[str, Any]] = []
    incoming = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return incoming.pop() if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [
        (b"host", b"bench"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"authorization", b"Bearer " + TOKEN),
    ]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    await app(scope, receive, send)
    if sent[0]["status"] != 200:
        raise RuntimeError(f"{path} answered {sent[0]['status']}: {sent[1]['body'][:200]!r}")
    return sent[1]["body"]


async def rollout(app: Any, i: int) -> None:
    """One rollout's three requests, as a runner makes them."""
    await request(app, "/v1/store/rollouts", b'{"tasks": [{"input": {"i": %d}}]}' % i)
    claim = json.loads(await request(app, "/v1/store/claims", b'{"worker_id": "w"}'))
    rid, aid = claim["rollout"]["rollout_id"], claim["attempt"]["attempt_id"]
    report = REPORT.replace(b"@RID@", rid.encode()).replace(b"@AID@", aid.encode())
    await request(app, f"/v1/store/attempts/{aid}/complete", report)


async def cpu_us_per_rollout(rollouts: int) -> float:
    """CPU microseconds per rollout over ``rollouts`` rollouts, after 200 to warm up."""
    app = store_app(InMemoryStore(), token=TOKEN.decode())
    for i in range(200):
        await rollout(app, i)
    started = time.process_time()
    for i in range(rollouts):
        await rollout(app, i)
    return (time.process_time() - started) / rollouts * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = [asyncio.run(cpu_us_per_rollout(args.rollouts)) for _ in range(args.repeats)]
    each = ", ".join(f"{r:.0f}" for r in runs)
    print(f"store app CPU per rollout: {min(runs):.0f} us (runs: {each})")


if __name__ == "__main__":
    main()
