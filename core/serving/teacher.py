"""A teacher: any Python policy function served as an OpenAI-compatible chat-completions endpoint.

A model that never calls its tools zero-shot gives RL nothing to learn from. A scripted teacher
plays the task instead, the way a hosted API would answer; ``Trainer.dev`` records its episodes
through the agent's own code and the gateway, and :class:`voltrl.SFT` warms the student up on
them (``docs/own_agent_real_model.md``). The policy is a plain function::

    def policy(messages: list[dict], tools: list[dict]) -> str | dict | list[dict]:
        ...

``messages`` and ``tools`` are the request's, as the agent sent them (OpenAI shapes). It returns

- a ``str``: the assistant's text;
- a tool call ``{"name": "convert", "arguments": {...}}`` (``arguments``: a dict, or a JSON
  object as a string), or a list of them: the reply's ``tool_calls``, ``finish_reason``
  ``"tool_calls"``;
- an assistant message ``{"content": ..., "tool_calls": [...]}`` (``role`` optional; each call
  as above or in OpenAI's ``{"id", "type", "function": {"name", "arguments"}}``).

It may be ``async def`` (a plain function runs on a worker thread, so a slow one holds up no
other request), and it gets two more arguments by naming them (keyword):

- ``rng``: a :class:`random.Random` seeded by the server's seed and the request's first user
  message, so every call of one episode draws the same numbers (a teacher that decides to err
  on a task errs the same way on each of its calls) and a re-run records the same episodes;
- ``request``: the whole request body (``tool_choice``, ``max_tokens``...).

:func:`teacher_app` is the app (``POST /v1/chat/completions``, plain or streamed, and
``GET /v1/models``); :func:`serve_teacher` serves it from a thread for a script
(``with serve_teacher(policy) as url:``); ``voltrl teacher serve module:function`` from the shell;
:func:`load_policy` finds ``module:function`` or ``path/to/file.py:function``. Tool calls get
ids derived from the request, so a re-run records the same conversations. A policy that raises,
or returns something else, answers 500 with the reason (and ``x-should-retry: false``: OpenAI
clients do not call it again) and the server keeps serving: a teacher bug shows up as the
rollout's error, not as a silent default reply.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from voltrl._imports import import_named
from voltrl.errors import VoltRLError

Reply = str | dict[str, Any] | list[dict[str, Any]]
"""What a policy returns: text, a tool call, a list of tool calls, or an assistant message."""
Policy = Callable[..., Reply | Awaitable[Reply]]
"""``policy(messages, tools[, rng=..., request=...])``: see the module's docstring."""

EXTRAS = ("rng", "request")
"""The keyword arguments a policy gets when its signature names them (or takes ``**kwargs``)."""

log = logging.getLogger("voltrl.teacher")


class BadReply(ValueError):
    """A policy's reply that is not text, tool calls or an assistant message."""


def load_policy(target: str) -> Policy:
    """The function ``target`` names: ``package.module:function`` (imported with the current
    directory on ``sys.path``) or ``path/to/file.py:function`` (its folder on ``sys.path``, so
    it may import the files beside it). Raises :class:`VoltRLError` saying what is wrong."""
    policy = import_named(
        target,
        kind="teacher",
        noun="FUNCTION",
        example="my_teacher.py:policy",
        own_module_name=True,  # two samples' teacher.py files load side by side
    )
    if not callable(policy):
        raise VoltRLError(f"{target} is {_a(policy)}, not a function")
    return policy


def _extras(policy: Policy) -> tuple[str, ...]:
    """The extras ``policy`` takes; a :class:`VoltRLError` unless it takes ``(messages, tools)``
    with them."""
    try:
        signature = inspect.signature(policy)
    except (TypeError, ValueError):  # a builtin: give it the two it surely takes
        return ()
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        wanted = EXTRAS
    else:
        wanted = tuple(name for name in EXTRAS if name in signature.parameters)
    try:
        signature.bind([], [], **dict.fromkeys(wanted))
    except TypeError as exc:
        name = getattr(policy, "__qualname__", repr(policy))
        raise VoltRLError(
            f"teacher policy {name}{signature} cannot be called as policy(messages, tools"
            f"{''.join(f', {w}=...' for w in wanted)}): {exc}"
        ) from None
    return wanted


def episode_rng(seed: int, messages: Any) -> random.Random:
    """The rng of a request: the same for every call of an episode (the same seed and first user
    message)."""
    first = ""
    for message in messages if isinstance(messages, list) else []:
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            first = content if isinstance(content, str) else json.dumps(content)
            break
    digest = hashlib.sha256(f"{seed}\n{first}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def assistant_message(reply: Any, ids: Iterator[str]) -> dict[str, Any]:
    """The OpenAI assistant message of a policy's ``reply``; tool calls without an id take the
    next of ``ids``. Raises :class:`BadReply` for any other shape."""
    if isinstance(reply, str):
        return {"role": "assistant", "content": reply}
    if isinstance(reply, list):
        if not reply:
            raise BadReply("an empty list (a list is tool calls: give at least one)")
        return {"role": "assistant", "content": None, "tool_calls": _calls(reply, ids)}
    if not isinstance(reply, dict):
        raise BadReply(_a(reply))
    if {"content", "tool_calls", "role"} & reply.keys():
        unknown = sorted(set(reply) - {"content", "tool_calls", "role"})
        if unknown:
            raise BadReply(f"a message with unknown keys {unknown}")
        if reply.get("role", "assistant") != "assistant":
            raise BadReply(f"a message of role {reply['role']!r}")
        content = reply.get("content")
        if content is not None and not isinstance(content, str):
            raise BadReply(f"a message whose content is {_a(content)}")
        message: dict[str, Any] = {"role": "assistant", "content": content}
        calls = reply.get("tool_calls") or []
        if not isinstance(calls, list):
            raise BadReply(f"a message whose tool_calls is {_a(calls)}, not a list")
        if calls:
            message["tool_calls"] = _calls(calls, ids)
        elif content is None:
            raise BadReply("a message with neither content nor tool calls")
        return message
    if "name" in reply:
        return {"role": "assistant", "content": None, "tool_calls": _calls([reply], ids)}
    raise BadReply(f"a dict with keys {sorted(reply)}")


def _a(value: Any) -> str:
    """``"an int"``, ``"a str"``: the kind of ``value`` with its article."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _calls(calls: list[Any], ids: Iterator[str]) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` from ``{"name", "arguments"}`` or OpenAI-shaped calls."""
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise BadReply(f"a tool call that is {_a(call)}")
        function = call.get("function", call)
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise BadReply(f"a tool call without a name: {call!r}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                raise BadReply(f"tool call {name!r} with arguments that are not a JSON object")
        elif isinstance(arguments, dict):
            arguments = json.dumps(arguments)
        else:
            raise BadReply(f"tool call {name!r} with arguments that are {_a(arguments)}")
        out.append(
            {
                "id": call.get("id") or f"call_{next(ids)}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return out


EXPECTED = (
    "expected a str (the reply's text), a tool call {'name': ..., 'arguments': {...}}, a list "
    "of tool calls, or an assistant message {'content': ..., 'tool_calls': [...]}"
)


def _error(message: str, kind: str, code: int) -> JSONResponse:
    """An OpenAI-style error; ``x-should-retry: false`` tells OpenAI clients not to call a
    policy that failed again (it would fail the same way, and run its side effects twice)."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=code, headers={"x-should-retry": "false"})


def teacher_app(
    policy: Policy, *, seed: int = 0, model: str = "teacher", token: str | None = None
) -> ASGIApp:
    """The OpenAI-compatible app of ``policy``: ``POST /v1/chat/completions`` (plain or
    streamed) and ``GET /v1/models`` (``model``: the name it reports). ``seed`` seeds each
    episode's ``rng``. With a ``token`` every request needs ``Authorization: Bearer <token>``
    (clients pass it as their API key). A policy that cannot be called as
    ``policy(messages, tools)`` (with the extras it names) is a :class:`VoltRLError` here."""
    extras = _extras(policy)
    is_async = inspect.iscoroutinefunction(policy)
    name = getattr(policy, "__qualname__", "the policy")

    async def chat(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(f"invalid JSON body: {exc}", "invalid_request_error", 400)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error(
                "the body must be a JSON object with a messages list", "invalid_request_error", 400
            )
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]
        given = {"rng": episode_rng(seed, body["messages"]), "request": body}
        args = (body["messages"], body.get("tools") or [])
        kwargs = {k: given[k] for k in extras}
        try:
            if is_async:
                reply = policy(*args, **kwargs)
            else:  # on a worker thread: a slow policy (one asking a model) holds up no other
                reply = await run_in_threadpool(policy, *args, **kwargs)
            if inspect.isawaitable(reply):
                reply = await reply
        except Exception as exc:  # a bug in the policy: say so to the caller, keep serving
            log.exception("teacher policy %s failed", name)
            return _error(
                f"teacher policy failed: {type(exc).__name__}: {exc}", "teacher_error", 500
            )
        try:
            message = assistant_message(reply, (f"{digest}_{i}" for i in itertools.count()))
        except BadReply as exc:
            text = f"teacher policy {name} returned {exc}: {EXPECTED}"
            log.error("%s", text)
            return _error(text, "teacher_error", 500)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        head = {"id": f"chatcmpl-{digest}", "created": int(time.time()), "model": model}
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        if body.get("stream"):
            options = body.get("stream_options")
            with_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            chunks = _chunks(head, message, finish, usage if with_usage else None)
            return StreamingResponse(chunks, media_type="text/event-stream")
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        return JSONResponse(
            {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
        )

    async def models(_: Request) -> Response:
        listed = {"id": model, "object": "model", "created": 0, "owned_by": "voltrl-teacher"}
        return JSONResponse({"object": "list", "data": [listed]})

    app: ASGIApp = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )
    if token:
        from voltrl._http.auth import BearerAuth

        app = BearerAuth(app, token)
    return app


def _chunks(
    head: dict[str, Any], message: dict[str, Any], finish: str, usage: dict[str, int] | None
) -> Iterator[str]:
    """The SSE stream of one message: the whole delta in one chunk, then the finish (and the
    usage, when the request's ``stream_options`` ask for it)."""
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    chunks: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
    ]
    if usage is not None:
        chunks.append({"choices": [], "usage": usage})
    for chunk in chunks:
        yield f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', **chunk})}\n\n"
    yield "data: [DONE]\n\n"


@contextmanager
def serve_teacher(
    policy: Policy | str,
    *,
    seed: int = 0,
    model: str = "teacher",
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
) -> Iterator[str]:
    """Serve ``policy`` (a function, or a :func:`load_policy` target) from a thread of its own
    while the block runs, and yield its OpenAI base URL (``http://127.0.0.1:PORT/v1``).
    ``port=0`` picks a free port; off loopback a ``token`` is required."""
    from voltrl._http.serving import require_token_off_loopback, serve_in_thread

    require_token_off_loopback(host, token)
    found = load_policy(policy) if isinstance(policy, str) else policy
    app = teacher_app(found, seed=seed, model=model, token=token)
    with serve_in_thread(app, host, port) as server:
        yield f"{server.url}/v1"
