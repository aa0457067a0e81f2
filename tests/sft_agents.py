"""The adding agent, its scripted teacher and a tiny student model on disk: what the SFT and
redaction tests record and train."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

import voltrl as vl
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
ADDING_AGENT = f"{Path(__file__).resolve()}:adding_agent"
"""The agent as ``voltrl train`` names it."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]


def teacher_module() -> Any:
    path = ROOT / "samples" / "teacher_server.py"
    spec = importlib.util.spec_from_file_location("samples_teacher_server", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def adding_teacher(request: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """Calls ``add`` with the question's numbers, then answers with the tool's result; wrong
    (adds one) when the rng says so, the same way on every call of the episode."""
    messages = request["messages"]
    a, b = (int(x) for x in messages[0]["content"].split()[-2:])
    wrong = rng.random() < 0.5
    if messages[-1]["role"] == "tool":
        return {"content": f"The sum is {int(messages[-1]['content']) + wrong}."}
    return {"tool_calls": [{"name": "add", "arguments": {"a": a, "b": b}}]}


@vl.rollout
async def adding_agent(task: dict, llm: vl.LLM) -> float:
    """Ask for a sum with an ``add`` tool; at most two tool rounds; reward 1 when right."""
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Add {task['a']} {task['b']}"}]
    for _ in range(3):
        reply = await client.chat.completions.create(
            model=llm.model, messages=messages, tools=TOOLS, **llm.sampling_parameters
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            return float(str(task["a"] + task["b"]) in (message.content or ""))
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}
            )
    return 0.0


TASKS = [{"a": a, "b": b} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 1), (2, 2)]]


def record_teacher_run(tmp_path: Path, name: str = "teacher") -> Path:
    """A ``dev`` run of :func:`adding_agent` against the scripted teacher, recorded without
    token ids; returns its run directory."""
    teacher = teacher_module()
    with teacher.serve_teacher(adding_teacher, seed=0) as url:
        trainer = vl.Trainer(
            resources={"main_llm": vl.LLM(endpoint=url, model="teacher")},
            request_token_ids=False,
            run_dir=tmp_path / "runs",
            name=name,
            n_runners=1,
            inline=True,
            progress=False,
        )
        result = trainer.dev(adding_agent, TASKS)
    assert result.stats.failed == 0
    return Path(result.run_dir)


def tiny_model_dir(tmp_path: Path) -> Path:
    tok = build_tiny_tokenizer()
    path = tmp_path / "student"
    build_tiny_model(tok, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path
