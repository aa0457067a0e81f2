"""Adapters that plug our implementation into the peer harness in ``shared/bench/peer``.

``OursProxyAdapter`` fills the harness's ``OursProxyAdapter`` slot of ``proxy_overhead.py``: it
runs ``voltrl.gateway.proxy`` in its own process (uvicorn, InMemoryStore, as
``benchmarks/gateway_bench.py`` does) in front of the harness's fake backend, gives each client
slot its own rollout-scoped URL, and verifies that every call was recorded with token ids.
``benchmarks/run_peer_proxy.py`` registers it and runs the harness with ``--impl ours``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_bench import GatewayProcess, stop


class OursProxyAdapter:
    """The harness's proxy adapter protocol (start, variants, headers, verify, pids, stop)."""

    name = "ours"
    rollouts = 64  # client slots the harness may ask for

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.headers: dict[str, str] = {}
        self.gateway: GatewayProcess | None = None

    async def start(self, backend_base: str) -> None:
        """Start the gateway process in front of ``backend_base`` (``http://127.0.0.1:P/v1``)."""
        self.gateway = await asyncio.to_thread(GatewayProcess, backend_base, self.rollouts)

    async def variants(self, n: int) -> dict[str, list[str]]:
        """One variant, ``voltrl_gateway``: n rollout-scoped URLs (every call is recorded)."""
        assert self.gateway is not None
        if n > self.rollouts:
            raise ValueError(f"at most {self.rollouts} client slots; asked for {n}")
        return {"voltrl_gateway": self.gateway.urls(n)}

    async def verify(self, sent: dict[str, int]) -> dict[str, Any]:
        """LLMCalls in the store vs calls sent, and whether they carry the token ids."""
        assert self.gateway is not None
        stats = await asyncio.to_thread(self.gateway.stats)
        return {
            "requests_sent": sent.get("voltrl_gateway", 0),
            "llm_calls_recorded": stats["calls"],
            "llm_calls_with_token_ids": stats["with_token_ids"],
            "prompt_ids_len": stats["prompt_ids_len"],
            "response_ids_len": stats["response_ids_len"],
        }

    def pids(self) -> dict[str, int]:
        """The gateway process, for CPU and RSS figures."""
        return {"gateway": self.gateway.proc.pid} if self.gateway is not None else {}

    async def stop(self) -> None:
        """Stop the gateway process."""
        if self.gateway is not None:
            await asyncio.to_thread(stop, self.gateway.proc)
