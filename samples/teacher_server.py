"""A scripted teacher: an OpenAI-compatible chat-completions server that plays a sample's task
with a scripted policy instead of a model, the way a hosted API answers (no token ids).

The framework samples' CPU learning recipes (``samples/recipe_runner.py``, ``make learn``)
record a teacher's rollouts through the real framework and gateway with it, then warm-start a
tiny student on them (:class:`voltrl.SFT`) before RL. A sample's ``teacher.py`` defines the
policy::

    def teacher_reply(request: dict, rng: random.Random) -> dict:
        '''The assistant message ({"content": ...} or {"tool_calls": [...]}) for a request.'''

``rng`` is seeded by the teacher's seed and the request's first user message, so every call of
one episode draws the same numbers (a teacher that decides to make a mistake on a task makes
it consistently) and a re-run records the same rollouts.

Standalone, to try a sample's ``dev`` against it::

    python samples/teacher_server.py autogen_calc --port 8011 &
    python samples/autogen_calc/run.py dev --endpoint http://127.0.0.1:8011/v1 \\
        --model teacher --no-token-ids --n 50
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import itertools
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

Policy = Callable[[dict[str, Any], random.Random], dict[str, Any]]
"""A scripted teacher: a chat-completions request body and its rng → the assistant message."""

HERE = Path(__file__).resolve().parent


def load_policy(sample: str) -> Policy:
    """``teacher_reply`` of ``samples/<sample>/teacher.py``."""
    path = HERE / sample / "teacher.py"
    if str(HERE) not in sys.path:  # teachers share modules of this directory
        sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location(f"{sample}_teacher", path)
    if spec is None or spec.loader is None or not path.exists():
        raise SystemExit(f"no teacher for {sample!r}: {path} does not exist")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.teacher_reply


def _first_user_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else []:
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else json.dumps(content)
    return ""


def episode_rng(seed: int, body: dict[str, Any]) -> random.Random:
    """The rng of a request: the same for every call of an episode (same first user turn)."""
    digest = hashlib.sha256(f"{seed}\n{_first_user_text(body)}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _message(reply: dict[str, Any], ids: Iterator[str]) -> dict[str, Any]:
    """The OpenAI message of a policy's reply: tool calls get ids (``ids``: the same for the
    same request, so a re-run records the same conversations) and JSON arguments."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.get("content")}
    calls = reply.get("tool_calls") or []
    if calls:
        message["tool_calls"] = [
            {
                "id": call.get("id") or f"call_{next(ids)}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": call["arguments"]
                    if isinstance(call["arguments"], str)
                    else json.dumps(call["arguments"]),
                },
            }
            for call in calls
        ]
    return message


def teacher_app(policy: Policy, *, seed: int = 0, model: str = "teacher") -> Starlette:
    """The server: ``POST /v1/chat/completions`` (plain or streamed) and ``GET /v1/models``.

    A policy that raises answers 500 with the exception's text: a teacher bug shows up as the
    rollout's error, not as a silent default reply.
    """

    async def chat(request: Request) -> Response:
        body = await request.json()
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]
        try:
            message = _message(
                policy(body, episode_rng(seed, body)), (f"{digest}_{i}" for i in itertools.count())
            )
        except Exception as exc:  # a bug in a scripted policy: say so to the caller
            error = {"message": f"teacher policy failed: {type(exc).__name__}: {exc}"}
            return JSONResponse({"error": error}, status_code=500)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        head = {"id": f"chatcmpl-{digest}", "created": int(time.time()), "model": model}
        if body.get("stream"):
            return StreamingResponse(_chunks(head, message, finish), media_type="text/event-stream")
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        return JSONResponse(
            {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
        )

    async def models(_: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "teacher"}]}
        )

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )


def _chunks(head: dict[str, Any], message: dict[str, Any], finish: str) -> Iterator[str]:
    """The SSE stream of one message: the whole delta in one chunk, then the finish."""
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    for choice in (
        {"index": 0, "delta": delta, "finish_reason": None},
        {"index": 0, "delta": {}, "finish_reason": finish},
    ):
        chunk = {**head, "object": "chat.completion.chunk", "choices": [choice]}
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


@contextmanager
def serve_teacher(policy: Policy, *, seed: int = 0) -> Iterator[str]:
    """Serve ``policy`` on loopback (a thread of its own) and yield its ``.../v1`` URL."""
    from voltrl._http.serving import serve_in_thread

    with serve_in_thread(teacher_app(policy, seed=seed)) as server:
        yield f"{server.url}/v1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sample", help="a sample directory with a teacher.py (autogen_calc...)")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import uvicorn

    app = teacher_app(load_policy(args.sample), seed=args.seed)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
