"""The trainer's side of the agent service: publish the gateway, post each task, keep the reward.

The trainer never imports the agent: :class:`ServiceAgent` is a small VoltRL agent whose
rollout (1) publishes the gateway's address to the file the service watches, (2) posts the
task to the service with the rollout id as the trace id, and (3) returns the reward the
service sends back, which the runner records for the rollout.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import voltrl as vl
from voltrl.openai_clients import async_http_client

SERVICE_URL_ENV = "VOLTRL_AGENT_SERVICE_URL"
DEFAULT_SERVICE_URL = "http://127.0.0.1:8765"


class AgentClient:
    """Posts tasks to the agent service at ``url``."""

    def __init__(self, url: str | None = None, *, timeout: float = 600.0) -> None:
        self.url = (url or os.environ.get(SERVICE_URL_ENV) or DEFAULT_SERVICE_URL).rstrip("/")
        self.timeout = timeout

    async def chat(
        self, trace_id: str, sampling_params: dict[str, Any], **row: Any
    ) -> dict[str, Any]:
        """Run the agent on ``row`` on behalf of trace ``trace_id`` (the rollout id); returns
        the service's reply: ``{"reward", "answer", "error"}``."""
        body = {"trace_id": trace_id, "sampling_params": sampling_params, "row": row}
        # on the loop's shared connections: a new client per rollout would connect (and
        # read the CA certificates) again
        async with async_http_client(timeout=self.timeout) as http:
            response = await http.post(f"{self.url}/chat", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"agent service answered {response.status_code}: {response.text}")
        return response.json()


async def chat(trace_id: str, sampling_params: dict[str, Any], **row: Any) -> dict[str, Any]:
    """:meth:`AgentClient.chat` on the service at ``$VOLTRL_AGENT_SERVICE_URL``."""
    return await AgentClient().chat(trace_id, sampling_params, **row)


def gateway_base(llm: vl.LLM) -> str:
    """The gateway's plain OpenAI base URL (``http://host:port/v1``), without the rollout
    scoping a rollout's LLM carries: the service tags calls with a header instead."""
    endpoint = llm.endpoint.rstrip("/")
    if "/rollouts/" in endpoint:
        endpoint = endpoint[: endpoint.index("/rollouts/")] + "/v1"
    return endpoint


def publish_gateway(llm: vl.LLM, path: str | Path, trace_header: str = "x-rollout-id") -> bool:
    """Write where the LLM is to ``path`` (atomically, only when it changed); returns whether
    it wrote. The service re-reads the file when it changes."""
    path = Path(path)
    config = {
        "endpoint": gateway_base(llm),
        "model": llm.model,
        "api_key": llm.api_key,
        "trace_header": trace_header,
    }
    text = json.dumps(config, indent=2, sort_keys=True)
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return True


class ServiceAgent(vl.LitAgent):
    """A rollout = one ``/chat`` request to the agent service; the reward comes back in it.

    Args:
        service_url: the service's base URL (default ``$VOLTRL_AGENT_SERVICE_URL``).
        gateway_file: where to publish the gateway for the service (the file the service
            reads, ``$VOLTRL_GATEWAY_FILE`` there).
        llm: the name of the LLM resource to hand over.
    """

    name = "agent_service"

    def __init__(
        self, service_url: str | None, gateway_file: str | Path, llm: str = "main_llm"
    ) -> None:
        self.service_url = service_url
        self.gateway_file = str(gateway_file)
        self.llm = llm

    async def rollout(
        self, task: dict[str, Any], resources: vl.Resources, ctx: vl.RolloutContext
    ) -> float:
        """Publish the gateway, post the task, return the reward the service computed."""
        llm = resources[self.llm]
        assert isinstance(llm, vl.LLM)
        publish_gateway(llm, self.gateway_file)
        client = AgentClient(self.service_url)
        reply = await client.chat(ctx.rollout_id, llm.sampling_parameters, **task)
        return float(reply["reward"])
