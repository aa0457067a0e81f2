"""The unit-conversion agent as its own FastAPI service (OpenAI Agents SDK), not imported by
the trainer.

``POST /chat`` with ``{"trace_id": ..., "sampling_params": {...}, "row": {...}}`` runs the SDK
agent on the row and answers ``{"reward": ..., "answer": ...}``. Every LLM call of that
request carries the trace id in the gateway's trace header, so the trainer's gateway records
it against the rollout; a context variable per request keeps concurrent requests apart.

Where the LLM is: the trainer writes the gateway's address to the JSON file named by
``VOLTRL_GATEWAY_FILE`` (``{"endpoint", "model", "api_key", "trace_header"}``). The service
reads it again whenever it changes, so a gateway restarted on a new port is picked up.

    VOLTRL_GATEWAY_FILE=/tmp/gateway.json python samples/agent_service/service.py --port 8765
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
from agents import Agent, Runner, function_tool
from agents.exceptions import AgentsException
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).resolve().parent))

from units import convert_units, reward

from voltrl.adapters import openai_agents as vla
from voltrl.adapters.openai_client import request_headers
from voltrl.resources import LLM

GATEWAY_FILE_ENV = "VOLTRL_GATEWAY_FILE"
INSTRUCTIONS = (
    "You convert units. Call the convert tool with the value and the unit symbols "
    "(mm, cm, m, km, in, ft, mi, g, kg, oz, lb), then answer with the number only."
)
MAX_TURNS = 4


class ChatRequest(BaseModel):
    """One task for the agent, on behalf of one rollout."""

    trace_id: str
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    row: dict[str, Any]


class ChatResponse(BaseModel):
    """The agent's answer, its reward, and why the agent gave up, if it did."""

    reward: float
    answer: str | None = None
    error: str | None = None


class GatewayConfig(BaseModel):
    """What the trainer publishes: the gateway's OpenAI base URL and how to tag calls."""

    endpoint: str
    model: str
    api_key: str = "EMPTY"
    trace_header: str = "x-rollout-id"


@function_tool
def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a value between units of length (mm, cm, m, km, in, ft, mi) or mass
    (g, kg, oz, lb)."""
    return f"{convert_units(value, from_unit, to_unit):.6g}"


class GatewayWatcher:
    """The published gateway, re-read whenever its file changes (checked on each request),
    and one SDK model per gateway, shared by concurrent requests."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None
        self._config: GatewayConfig | None = None
        self._models: dict[tuple[str, str, str], vla.VoltRLChatCompletionsModel] = {}

    def current(self) -> tuple[GatewayConfig, vla.VoltRLChatCompletionsModel]:
        """The gateway to use now and its model; ``LookupError`` when none is published."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            raise LookupError(f"no gateway published at {self.path} yet") from None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp != self._stamp or self._config is None:
            self._config = GatewayConfig.model_validate_json(self.path.read_text())
            self._stamp = stamp
        cfg = self._config
        key = (cfg.endpoint, cfg.model, cfg.api_key)
        if key not in self._models:
            llm = LLM(endpoint=cfg.endpoint, model=cfg.model, api_key=cfg.api_key, gateway=True)
            self._models[key] = vla.model(llm)
        return cfg, self._models[key]

    async def aclose(self) -> None:
        """Close every model's HTTP client."""
        for model in self._models.values():
            await model.aclose()
        self._models.clear()


async def run_agent(
    row: dict[str, Any], sampling_params: dict[str, Any], model: vla.VoltRLChatCompletionsModel
) -> ChatResponse:
    """Run the SDK agent on one row and score its answer. The agent's own failures (too many
    turns, a malformed reply) score 0; the LLM being unreachable is raised."""
    agent = Agent(
        name="converter",
        instructions=INSTRUCTIONS,
        model=model,
        model_settings=vla.model_settings(sampling_params),
        tools=[convert],
    )
    try:
        result = await Runner.run(agent, row["question"], max_turns=MAX_TURNS)
    except AgentsException as exc:
        return ChatResponse(reward=0.0, error=f"{type(exc).__name__}: {exc}")
    answer = str(result.final_output)
    return ChatResponse(reward=reward(answer, row), answer=answer)


def create_app(gateway_file: str | Path | None = None) -> FastAPI:
    """The service; ``gateway_file`` defaults to ``$VOLTRL_GATEWAY_FILE``."""
    path = gateway_file or os.environ.get(GATEWAY_FILE_ENV)
    if not path:
        raise SystemExit(f"set {GATEWAY_FILE_ENV} to the file the trainer publishes to")
    watcher = GatewayWatcher(path)
    # The SDK would send its traces to OpenAI's servers; with VoltRL's processor in place of
    # its exporter they stay here (no rollout runs in this process, so they are dropped).
    vla.install_tracing()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await watcher.aclose()

    app = FastAPI(title="unit-conversion agent", lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        try:
            cfg, _ = watcher.current()
        except LookupError:
            return {"status": "ok", "gateway": None}
        return {"status": "ok", "gateway": cfg.endpoint}

    @app.post("/chat")
    async def chat(req: ChatRequest) -> ChatResponse:
        try:
            cfg, model = watcher.current()
        except LookupError as exc:
            raise HTTPException(503, str(exc)) from None
        # Each request runs in its own task: this header reaches only its own LLM calls.
        with request_headers({cfg.trace_header: req.trace_id}):
            try:
                return await run_agent(req.row, req.sampling_params, model)
            except openai.APIError as exc:
                raise HTTPException(502, f"the LLM failed: {exc}") from None

    return app


def main(argv: list[str] | None = None) -> None:
    """Serve the agent with uvicorn."""
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args(argv)
    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
