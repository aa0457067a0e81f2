"""A fake vLLM-style OpenAI-compatible server on 127.0.0.1, for gateway tests and benchmarks.

Real HTTP/1.1 (keep-alive, chunked streaming) on raw asyncio, so it is fast enough to be a
benchmark baseline. It answers ``/v1/chat/completions`` and ``/v1/completions`` the way vLLM
does with ``return_token_ids`` (``prompt_token_ids`` on the response, or per choice for
completions, and ``choices[i].token_ids``) and ``logprobs``; streams SSE chunks; returns
``n`` choices; calls the first tool when given tools; and can be scripted to fail, or to
answer as a scripted agent backend (``fb.script``, e.g. :func:`tool_then_answer`).

Everything is deterministic, so tests can compute what should have been recorded:
:func:`prompt_ids`, :func:`reply_text`, :func:`reply_ids` and :func:`reply_logprobs`.

In-process: ``async with FakeBackend() as fb: fb.url`` (``fb.fail_next(429, 500)``,
``fb.requests``, ``fb.hold``, ``fb.hung_up``). As a process: ``python
tests/fake_openai_backend.py`` (a port the OS picks, or ``--port P``) prints ``serving URL``
once it listens (:func:`helpers.FakeBackendProcess` reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import deque
from collections.abc import Callable
from typing import Any

MODEL = "fake-model"
TOOL_ARGS = ['{"city": ', '"Paris"}']


def _text_of(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "\n".join(
            f"{m.get('role')}:{m.get('content') if isinstance(m.get('content'), str) else ''}"
            for m in body["messages"]
        )
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def prompt_ids(body: dict[str, Any]) -> list[int]:
    """The prompt token ids the fake 'tokenizer' gives a request (one id per character)."""
    return [1000 + (ord(c) % 5000) for c in _text_of(body)]


def reply_text(index: int) -> str:
    """The text of choice ``index``."""
    return f"Answer {index}."


def reply_ids(index: int) -> list[int]:
    """The sampled token ids of choice ``index`` (one per character of its text)."""
    return [20000 + 100 * index + k for k in range(len(reply_text(index)))]


def reply_logprobs(index: int) -> list[float]:
    """The logprob of each sampled token of choice ``index``."""
    return [-0.5 * (k + 1) / (index + 1) for k in range(len(reply_text(index)))]


def tool_call_ids(index: int) -> list[int]:
    """The sampled token ids of choice ``index`` when it calls a tool."""
    return [30000 + 100 * index + k for k in range(len(TOOL_ARGS))]


Script = Callable[[dict[str, Any]], "dict[str, str] | None"]
"""A scripted backend: a request's reply (``{"text": ...}``, ``{"tool": ..., "arguments":
...}``), a refusal (``{"error": message, "status": 400}``) or None (the default reply)."""


def scripted_ids(text: str) -> list[int]:
    """The token ids of a scripted reply or tool-call arguments: one per character."""
    return [40000 + ord(ch) for ch in text]


def _scripted_reply_ids(reply: dict[str, str]) -> list[int]:
    """A scripted reply's ids: :func:`scripted_ids` of its tool-call arguments or text."""
    return scripted_ids(reply.get("arguments", "{}") if "tool" in reply else reply["text"])


def tool_then_answer(arguments: str, answer: str, tool: str | None = None) -> Script:
    """A script for agent tests: call a tool (``tool``, else the first one offered) with
    ``arguments`` (JSON text) until the conversation holds a tool result, then say ``answer``.

    ``fb.script = tool_then_answer('{"expression": "2+3"}', "5")``.
    """

    def script(req: dict[str, Any]) -> dict[str, str] | None:
        messages = req.get("messages") or []
        if any(m.get("role") == "tool" for m in messages) or not req.get("tools"):
            return {"text": answer}
        return {"tool": tool or req["tools"][0]["function"]["name"], "arguments": arguments}

    return script


class FakeBackend:
    """The server. ``token_ids=False`` behaves like a hosted API (no token ids)."""

    def __init__(self, *, token_ids: bool = True, port: int = 0) -> None:
        self.token_ids = token_ids
        self.port = port
        self.requests: list[dict[str, Any]] = []
        self.failures: deque[int] = deque()
        self.failure_message: str | None = None
        self.hold: asyncio.Event | None = None
        #: A streamed reply sends its first event, then waits for this before the rest.
        self.hold_stream: asyncio.Event | None = None
        self.arrived = asyncio.Event()
        #: Set when a client closes its connection while its request is being answered.
        self.hung_up = asyncio.Event()
        self.record_requests = True
        self.script: Script | None = None
        #: How prompts and scripted replies become token ids (default: one id per
        #: character); a test may put a real tokenizer and chat template here. Streamed
        #: scripted replies need one id per character (the default).
        self.prompt_ids: Callable[[dict[str, Any]], list[int]] = prompt_ids
        self.reply_ids: Callable[[dict[str, str]], list[int]] = _scripted_reply_ids
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._counter = 0
        self._reply: dict[str, str] | None = None

    @property
    def url(self) -> str:
        """The OpenAI base URL (``http://127.0.0.1:P/v1``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def fail_next(self, *statuses: int, message: str | None = None) -> None:
        """Answer the next completion requests with these HTTP statuses, in order, and
        ``message`` as the error's message (default: ``scripted failure <status>``)."""
        self.failures.extend(statuses)
        self.failure_message = message

    async def start(self) -> FakeBackend:
        """Listen on 127.0.0.1 (a free port unless one was given)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Conn(self), "127.0.0.1", self.port, backlog=1024
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Stop listening and close connections."""
        if self._server is not None:
            self._server.close()
            for conn in list(self._conns):
                if conn.transport is not None:
                    conn.transport.close()
            await self._server.wait_closed()

    async def __aenter__(self) -> FakeBackend:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- answers ----------------------------------------------------------------------
    async def answer(
        self,
        method: str,
        path: str,
        body: bytes,
        conn: _Conn,
        authorization: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        path = path.split("?", 1)[0]
        if path in ("/health", "/v1/models"):
            data = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
            conn.reply(200, json.dumps(data).encode())
            return
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            conn.reply(404, b'{"error": {"message": "not found", "type": "not_found"}}')
            return
        req = json.loads(body)
        if self.record_requests:
            self.requests.append(
                {"path": path, "body": req, "authorization": authorization, "headers": headers}
            )
        self.arrived.set()
        if self.hold is not None:
            await self.hold.wait()
        if self.failures:
            status = self.failures.popleft()
            message = self.failure_message or f"scripted failure {status}"
            err = {"error": {"message": message, "type": "server_error"}}
            conn.reply(status, json.dumps(err).encode(), retry_after=status == 429)
            return
        self._counter += 1
        chat = path.endswith("/chat/completions")
        self._reply = self.script(req) if self.script is not None and chat else None
        if self._reply is not None and "error" in self._reply:  # a scripted refusal
            err = {"error": {"message": self._reply["error"], "type": "invalid_request_error"}}
            conn.reply(int(self._reply.get("status", 400)), json.dumps(err).encode())
            return
        if req.get("stream"):
            events = [_sse(c) for c in self._chunks(req, chat)] + [b"data: [DONE]\n\n"]
            await conn.stream(events, hold_after_first=self.hold_stream)
        else:
            conn.reply(200, json.dumps(self._full(req, chat)).encode())

    def _choices(self, req: dict[str, Any], chat: bool) -> list[dict[str, Any]]:
        """Per choice: text pieces, token ids, logprobs, finish reason, tool call or None."""
        scripted = self._reply
        if scripted is not None:
            return [self._scripted(scripted, i) for i in range(req.get("n") or 1)]
        uses_tool = chat and req.get("tools") and req.get("tool_choice") != "none"
        out = []
        for i in range(req.get("n") or 1):
            if uses_tool:
                name = req["tools"][0]["function"]["name"]
                tool = {"id": f"call_{self._counter}_{i}", "name": name}
                ids, pieces, finish = tool_call_ids(i), [], "tool_calls"
            else:
                tool, ids, pieces = None, reply_ids(i), list(reply_text(i))
                finish = "stop"
            lps = [-0.25 * (k + 1) for k in range(len(ids))] if tool else reply_logprobs(i)
            out.append(
                {
                    "pieces": pieces,
                    "ids": ids,
                    "lps": lps,
                    "finish": finish,
                    "tool": tool,
                    "args": TOOL_ARGS,
                }
            )
        return out

    def _scripted(self, reply: dict[str, str], i: int) -> dict[str, Any]:
        """A scripted choice: one piece per character, ids from :attr:`reply_ids`."""
        ids = self.reply_ids(reply)
        if "tool" in reply:
            args = reply.get("arguments", "{}")
            tool = {"id": f"call_{self._counter}_{i}", "name": reply["tool"]}
            return {
                "pieces": [],
                "ids": ids,
                "lps": [-0.1] * len(ids),
                "finish": "tool_calls",
                "tool": tool,
                "args": list(args),
            }
        text = reply["text"]
        return {
            "pieces": list(text),
            "ids": ids,
            "lps": [-0.1] * len(ids),
            "finish": "stop",
            "tool": None,
            "args": [],
        }

    def _logprobs(self, req: dict[str, Any], chat: bool, lps: list[float], n: int) -> Any:
        if chat and req.get("logprobs"):
            content = [
                {"token": f"t{k}", "logprob": lp, "bytes": None, "top_logprobs": []}
                for k, lp in enumerate(lps[:n])
            ]
            return {"content": content}
        if not chat and req.get("logprobs") is not None:
            return {
                "tokens": [f"t{k}" for k in range(n)],
                "token_logprobs": lps[:n],
                "top_logprobs": [None] * n,
                "text_offset": list(range(n)),
            }
        return None

    def _full(self, req: dict[str, Any], chat: bool) -> dict[str, Any]:
        want_ids = self.token_ids and req.get("return_token_ids")
        pids = self.prompt_ids(req)
        choices = []
        for i, c in enumerate(self._choices(req, chat)):
            choice: dict[str, Any] = {"index": i}
            if chat:
                msg: dict[str, Any] = {"role": "assistant", "content": "".join(c["pieces"]) or None}
                if c["tool"]:
                    fn = {"name": c["tool"]["name"], "arguments": "".join(c["args"])}
                    msg["tool_calls"] = [
                        {"id": c["tool"]["id"], "type": "function", "function": fn}
                    ]
                else:
                    msg["tool_calls"] = []
                choice["message"] = msg
            else:
                choice["text"] = "".join(c["pieces"])
            choice["logprobs"] = self._logprobs(req, chat, c["lps"], len(c["ids"]))
            choice["finish_reason"] = c["finish"]
            choice["stop_reason"] = None
            if want_ids:
                choice["token_ids"] = c["ids"]
                if not chat:
                    choice["prompt_token_ids"] = pids
            choices.append(choice)
        out: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-fake-{self._counter}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": req.get("model") or MODEL,
            "choices": choices,
            "usage": _usage(pids, choices),
        }
        if chat and want_ids:
            out["prompt_token_ids"] = pids
        return out

    def _chunks(self, req: dict[str, Any], chat: bool) -> list[dict[str, Any]]:
        want_ids = self.token_ids and req.get("return_token_ids")
        pids = self.prompt_ids(req)
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-fake-{self._counter}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": req.get("model") or MODEL,
        }
        chunks: list[dict[str, Any]] = []
        total = 0
        for i, c in enumerate(self._choices(req, chat)):
            total += len(c["ids"])
            steps = len(c["ids"])
            if steps != len(c["args"] if c["tool"] else c["pieces"]):
                raise ValueError("a streamed reply needs one token id per character")
            for k in range(steps):
                choice: dict[str, Any] = {"index": i}
                if chat:
                    delta: dict[str, Any] = {"role": "assistant"} if k == 0 else {}
                    if c["tool"]:
                        fn = {"arguments": c["args"][k]}
                        tc: dict[str, Any] = {"index": 0, "function": fn}
                        if k == 0:
                            tc.update(id=c["tool"]["id"], type="function")
                            fn["name"] = c["tool"]["name"]
                        delta["tool_calls"] = [tc]
                    else:
                        delta["content"] = c["pieces"][k]
                    choice["delta"] = delta
                else:
                    choice["text"] = c["pieces"][k]
                lp = self._logprobs(req, chat, c["lps"][k:], 1)
                if lp is not None and not chat:
                    lp["text_offset"] = [k]
                choice["logprobs"] = lp
                choice["finish_reason"] = c["finish"] if k == steps - 1 else None
                if want_ids:
                    choice["token_ids"] = [c["ids"][k]]
                    if not chat and k == 0:
                        choice["prompt_token_ids"] = pids
                chunk = {**head, "choices": [choice]}
                if chat and want_ids and not chunks:
                    chunk["prompt_token_ids"] = pids
                chunks.append(chunk)
        opts = req.get("stream_options") or {}
        if opts.get("include_usage"):
            usage = {
                "prompt_tokens": len(pids),
                "completion_tokens": total,
                "total_tokens": len(pids) + total,
            }
            chunks.append({**head, "choices": [], "usage": usage})
        return chunks


def _usage(pids: list[int], choices: list[dict[str, Any]]) -> dict[str, int]:
    completion = sum(len(c.get("token_ids") or []) for c in choices)
    return {
        "prompt_tokens": len(pids),
        "completion_tokens": completion,
        "total_tokens": len(pids) + completion,
    }


def _sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


_REASONS = {
    200: "OK",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    400: "Bad Request",
}


class _Conn(asyncio.Protocol):
    """One client connection: parses requests (Content-Length bodies) and answers in order."""

    def __init__(self, server: FakeBackend) -> None:
        self.server = server
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.queue: asyncio.Queue[tuple[str, str, bytes, bool, dict[str, str]]] = asyncio.Queue()
        self.keep_alive = True
        self.task: asyncio.Task[None] | None = None
        self.answering = False  # a request is being answered

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server._conns.add(self)
        self.task = asyncio.ensure_future(self._serve())

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._conns.discard(self)
        if self.answering:
            self.server.hung_up.set()
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buf[:end].decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {}
            for ln in lines[1:]:
                k, _, v = ln.partition(":")
                headers[k.strip().lower()] = v.strip()
            length = int(headers.get("content-length", 0))
            keep = headers.get("connection", "").lower() != "close"
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            self.queue.put_nowait((method, path, body, keep, headers))

    async def _serve(self) -> None:
        while True:
            method, path, body, self.keep_alive, headers = await self.queue.get()
            self.answering = True
            auth = headers.get("authorization", "")
            await self.server.answer(method, path, body, self, auth, headers)
            self.answering = False
            if not self.keep_alive and self.transport is not None:
                self.transport.close()
                return

    def _head(self, status: int, extra: str) -> bytes:
        conn = "keep-alive" if self.keep_alive else "close"
        return (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n{extra}"
            f"Connection: {conn}\r\n\r\n"
        ).encode()

    def reply(self, status: int, payload: bytes, *, retry_after: bool = False) -> None:
        extra = f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        if retry_after:
            extra += "Retry-After: 0\r\n"
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self._head(status, extra) + payload)

    async def stream(
        self, events: list[bytes], hold_after_first: asyncio.Event | None = None
    ) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        extra = "Content-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
        self.transport.write(self._head(200, extra))
        for i, ev in enumerate(events):
            self.transport.write(f"{len(ev):x}\r\n".encode() + ev + b"\r\n")
            await asyncio.sleep(0)
            if i == 0 and hold_after_first is not None:
                await hold_after_first.wait()
        self.transport.write(b"0\r\n\r\n")


THINKING_REPLY = (
    "<think>\nThe user asks a small arithmetic question. 2 + 2 is 4; answer briefly.\n</think>"
    "\n\nThe answer is 4."
)
"""What the backend answers with ``--think``: a reasoning model's reply, thinking first."""


async def _main(port: int, max_seconds: float, think: bool = False) -> None:
    backend = FakeBackend(port=port)
    backend.record_requests = False
    if think:
        backend.script = lambda req: {"text": THINKING_REPLY}
    await backend.start()
    print(f"serving {backend.url}", flush=True)
    try:
        await asyncio.sleep(max_seconds)
    finally:
        await backend.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=0, help="default: a free port the OS picks")
    ap.add_argument("--max-seconds", type=float, default=600.0)
    ap.add_argument("--think", action="store_true", help="answer like a reasoning model")
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.run(_main(args.port, args.max_seconds, args.think))
    except ImportError:
        asyncio.run(_main(args.port, args.max_seconds, args.think))
