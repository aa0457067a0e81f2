"""Agents that ``voltrl runner`` processes load in the fault tests (``tests/fault_agents.py:NAME``).

Task fields steer them:

- ``Trivial``: returns 1.0.
- ``Blocking``: writes ``{dir}/started-{rollout_id}-{attempt_id}``, then waits until the file
  ``{dir}/{gate}`` exists and returns 1.0.
- ``Recording``: emits a span, records one LLM call through the store's HTTP API (the store URL
  and token come from ``VOLTRL_FAULT_STORE`` and ``VOLTRL_TOKEN``), sleeps ``sleep`` seconds,
  and returns 1.0.
- ``CallsLLM``: one chat completion through the ``main_llm`` resource (a gateway), inside a
  span; then, if the task has a ``gate``, waits until the file ``{dir}/{gate}`` exists; sleeps
  ``sleep`` seconds and returns 1.0.
- ``SyncSleeper``: a sync agent that records its process id (an event ``pid``), sleeps
  ``sleep`` seconds in ``time.sleep`` and returns 1.0.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import voltrl as vl
from voltrl.store.http import HTTPStore
from voltrl.types import LLMCall


class Trivial(vl.LitAgent):
    """Returns 1.0 at once."""

    async def rollout(self, task: dict[str, Any], resources: vl.Resources) -> float:
        return 1.0


class Blocking(vl.LitAgent):
    """Marks that it started, then waits for a gate file."""

    async def rollout(self, task: dict[str, Any], resources: vl.Resources, ctx: Any) -> float:
        folder = Path(task["dir"])
        (folder / f"started-{ctx.rollout_id}-{ctx.attempt_id}").touch()
        while not (folder / task["gate"]).exists():
            await asyncio.sleep(0.05)
        return 1.0


class Recording(vl.LitAgent):
    """A span, an LLM call recorded over HTTP, a short sleep."""

    async def rollout(self, task: dict[str, Any], resources: vl.Resources, ctx: Any) -> float:
        with vl.span("work"):
            call = LLMCall(
                rollout_id=ctx.rollout_id,
                attempt_id=ctx.attempt_id,
                request={"i": task["i"]},
                response={},
            )
            store = HTTPStore(
                os.environ["VOLTRL_FAULT_STORE"], os.environ["VOLTRL_TOKEN"], retries=8
            )
            try:
                await store.add_llm_calls([call])
            finally:
                await store.close()
            await asyncio.sleep(task.get("sleep", 0.0))
        return 1.0


class CallsLLM(vl.LitAgent):
    """One chat completion through the gateway, then a wait for the task's gate file, if any."""

    async def rollout(self, task: dict[str, Any], resources: vl.Resources) -> float:
        from openai import AsyncOpenAI

        llm = resources["main_llm"]
        client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
        try:
            with vl.span("chat"):
                await client.chat.completions.create(
                    model=llm.model,
                    messages=[{"role": "user", "content": f"task {task['i']}"}],
                    max_tokens=4,
                )
        finally:
            await client.close()
        if "gate" in task:
            while not (Path(task["dir"]) / task["gate"]).exists():
                await asyncio.sleep(0.05)
        await asyncio.sleep(task.get("sleep", 0.0))
        return 1.0


class SyncSleeper(vl.LitAgent):
    """Records its process id, then sleeps (uninterruptibly) in its thread."""

    def rollout(self, task: dict[str, Any], resources: vl.Resources) -> float:
        vl.emit_event("pid", pid=os.getpid())
        time.sleep(task.get("sleep", 0.0))
        return 1.0
