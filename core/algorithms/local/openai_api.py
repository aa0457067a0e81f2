"""An OpenAI-compatible server on top of the LocalRL :class:`~.engine.Engine`, vLLM-flavoured.

``/v1/chat/completions`` (chat template with ``tools``, Hermes ``<tool_call>`` parsing into
OpenAI ``tool_calls``), ``/v1/completions``, ``/v1/models`` and ``/health``. Responses carry
what the gateway records, under vLLM's field names: with ``return_token_ids`` the prompt's ids
(``prompt_token_ids``: top level for chat, per choice for completions) and each choice's sampled
``token_ids``, on every streamed chunk too; ``logprobs`` as OpenAI shapes them. Logprobs are
the raw model logprobs at temperature 1 unless the app is built with
``logprobs_mode="processed"`` (see :mod:`.sampling`).

Any ``model`` name is accepted (the gateway forces its own); ``/v1/models`` reports the served
name. An engine serving LoRA adapters serves each under its own name, as vLLM's multi-LoRA
does: a request whose ``model`` names an adapter is generated with it (and its response says
that name), any other with the base model; ``/v1/models`` lists the adapters too.

Unsupported or malformed parameters get a 400 with an OpenAI-shaped error. There is no
guided decoding: ``tool_choice`` ``"required"`` or a named function is treated as ``"auto"``
(the model's output is parsed for calls); ``"none"`` turns parsing off.

A request whose client disconnects, streaming or not, is aborted: its sequences leave the
engine's batch at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from voltrl._http.serving import BackgroundServer, serve, serve_in_thread
from voltrl.algorithms.local.chat import ChatError, render_chat
from voltrl.algorithms.local.engine import (
    MAX_TOP_LOGPROBS,
    Choice,
    Engine,
    EngineError,
    SamplingParams,
)
from voltrl.algorithms.local.toolcalls import ToolStream, parse_tool_calls

LogprobsMode = Literal["raw", "processed"]


class BadRequest(Exception):
    """A request the server answers with a 400 and an OpenAI-shaped error."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-printable-character table that byte-level BPE vocabularies use."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return table


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


class _Tokens:
    """Per-token display strings and UTF-8 bytes for logprobs, cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        self.added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token_id)
        if hit is None:
            if token_id in self.added:
                raw = self.added[token_id].encode()
            else:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if self.byte_level and all(ch in _BYTE_DECODER for ch in piece):
                    raw = bytes(_BYTE_DECODER[ch] for ch in piece)
                else:
                    raw = self.tokenizer.decode([token_id]).encode()
            hit = self.cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit


class _Server:
    """The request handling behind :func:`create_app`."""

    def __init__(self, engine: Engine, model_name: str, logprobs_mode: LogprobsMode) -> None:
        self.engine, self.model_name, self.logprobs_mode = engine, model_name, logprobs_mode
        self.tokens = _Tokens(engine.tokenizer)
        self.created = int(time.time())

    # ---- request parsing --------------------------------------------------------------
    def sampling(self, body: dict[str, Any], chat: bool) -> SamplingParams:
        """Sampling parameters of an OpenAI/vLLM request body."""
        for name in ("presence_penalty", "frequency_penalty"):
            if body.get(name):
                raise BadRequest(f"{name} is not supported by the local engine", name)
        if body.get("repetition_penalty") not in (None, 1, 1.0):
            raise BadRequest("repetition_penalty is not supported", "repetition_penalty")
        if body.get("logit_bias"):
            raise BadRequest("logit_bias is not supported by the local engine", "logit_bias")
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise BadRequest(
                "only response_format {'type': 'text'} is supported", "response_format"
            )
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list):
            raise BadRequest("stop must be a string or a list of strings", "stop")
        max_tokens = body.get("max_tokens")
        if chat and body.get("max_completion_tokens") is not None:
            max_tokens = body["max_completion_tokens"]
        if not chat and max_tokens is None:
            max_tokens = 16  # the OpenAI (and vLLM) default for completions
        if chat:
            if body.get("top_logprobs") and not body.get("logprobs"):
                raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
            top = body.get("top_logprobs") or 0
        else:
            top = body.get("logprobs") or 0
            if not _is_count(top):
                raise BadRequest(
                    f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "logprobs"
                )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_default(body, "temperature", 1.0),
            top_p=_default(body, "top_p", 1.0),
            top_k=_default(body, "top_k", 0),
            n=_default(body, "n", 1),
            seed=body.get("seed"),
            stop=stop,
            stop_token_ids=body.get("stop_token_ids") or [],
            ignore_eos=bool(body.get("ignore_eos", False)),
            top_logprobs=top,
            skip_special_tokens=bool(body.get("skip_special_tokens", True)),
        )
        try:
            params.validate()
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return params

    def chat_prompt(self, body: dict[str, Any]) -> list[int]:
        """Render the chat template (with ``tools``) and tokenize it."""
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("chat_template_kwargs must be an object", "chat_template_kwargs")
        tok = self.engine.tokenizer
        try:
            text = render_chat(
                tok,
                body.get("messages"),
                body.get("tools"),
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                template_kwargs=kwargs,
            )
        except ChatError as e:
            raise BadRequest(str(e)) from e
        return tok.encode(text, add_special_tokens=False)

    def completion_prompts(self, body: dict[str, Any]) -> list[list[int]]:
        """The prompts of a completions request as token ids."""
        for name in ("echo", "suffix"):
            if body.get(name):
                raise BadRequest(f"{name} is not supported by the local engine", name)
        if body.get("best_of") not in (None, body.get("n", 1)):
            raise BadRequest("best_of other than n is not supported", "best_of")
        prompt = body.get("prompt")
        tok = self.engine.tokenizer
        if isinstance(prompt, str):
            return [tok.encode(prompt, add_special_tokens=False)]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [tok.encode(p, add_special_tokens=False) for p in prompt]
            if all(isinstance(t, int) for t in prompt):
                return [list(prompt)]
            if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
                return [list(p) for p in prompt]
        raise BadRequest(
            "prompt must be a string, a list of strings, a list of token ids or a list of lists "
            "of token ids",
            "prompt",
        )

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        try:
            self.engine.check(prompt, params)
        except ValueError as e:
            raise BadRequest(str(e)) from None

    def adapter(self, body: dict[str, Any]) -> str | None:
        """The LoRA adapter a request's ``model`` names, or None (the base model)."""
        model = body.get("model")
        return model if isinstance(model, str) and model in self.engine.adapters else None

    # ---- response pieces ---------------------------------------------------------------
    def _values(self, lps: list[float], slps: list[float]) -> list[float]:
        return slps if self.logprobs_mode == "processed" else lps

    def chat_logprobs(
        self, ids: list[int], values: list[float], tops: list[list[tuple[int, float]]]
    ) -> dict[str, Any]:
        content = []
        for tid, lp, top in zip(ids, values, tops, strict=True):
            text, raw = self.tokens(tid)
            alts = []
            for alt, alp in top:
                atext, araw = self.tokens(alt)
                alts.append({"token": atext, "logprob": alp, "bytes": araw})
            content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alts})
        return {"content": content}

    def completion_logprobs(
        self, ids: list[int], values: list[float], tops: list[list[tuple[int, float]]], offset: int
    ) -> dict[str, Any]:
        tokens, offsets = [], []
        for tid in ids:
            text = self.tokens(tid)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        top_dicts = [{self.tokens(a)[0]: lp for a, lp in top} if top else None for top in tops]
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": top_dicts,
            "text_offset": offsets,
        }

    def head(self, prefix: str, obj: str, body: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex[:24]}",
            "object": obj,
            "created": int(time.time()),
            "model": self.adapter(body) or self.model_name,
        }

    # ---- chat ----------------------------------------------------------------------------
    async def chat(self, body: dict[str, Any]) -> dict[str, Any] | StreamingResponse:
        params = self.sampling(body, chat=True)
        prompt = self.chat_prompt(body)
        self.check(prompt, params)
        tools = bool(body.get("tools")) and body.get("tool_choice") != "none"
        want_ids, want_lps = bool(body.get("return_token_ids")), bool(body.get("logprobs"))
        if body.get("stream"):
            return _EventStream(self.chat_stream(body, prompt, params, tools, want_ids, want_lps))
        out = await self.engine.generate(prompt, params, adapter=self.adapter(body))
        choices = []
        for c in out.choices:
            message: dict[str, Any] = {"role": "assistant", "content": c.text, "tool_calls": []}
            finish: str | None = c.finish_reason
            if tools:
                content, calls = parse_tool_calls(c.text)
                if calls:
                    message["content"], message["tool_calls"] = content, calls
                    finish = "tool_calls"
            choice: dict[str, Any] = {
                "index": c.index,
                "message": message,
                "logprobs": self._choice_logprobs(c, True) if want_lps else None,
                "finish_reason": finish,
                "stop_reason": c.stop_reason,
            }
            if want_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        resp = {**self.head("chatcmpl", "chat.completion", body), "choices": choices}
        resp["usage"] = _usage(len(prompt), sum(len(c.token_ids) for c in out.choices))
        if want_ids:
            resp["prompt_token_ids"] = prompt
        return resp

    def _choice_logprobs(self, c: Choice, chat: bool, offset: int = 0) -> dict[str, Any]:
        values = self._values(c.logprobs, c.sampling_logprobs)
        if chat:
            return self.chat_logprobs(c.token_ids, values, c.top_logprobs)
        return self.completion_logprobs(c.token_ids, values, c.top_logprobs, offset)

    async def chat_stream(
        self,
        body: dict[str, Any],
        prompt: list[int],
        params: SamplingParams,
        tools: bool,
        want_ids: bool,
        want_lps: bool,
    ) -> AsyncGenerator[bytes, None]:
        head = self.head("chatcmpl", "chat.completion.chunk", body)
        opts = body.get("stream_options")
        want_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        states = [ToolStream(tools) for _ in range(params.n)]
        generated = 0
        try:
            for i in range(params.n):
                first = {"index": i, "delta": {"role": "assistant", "content": ""}}
                chunk = {**head, "choices": [{**first, "logprobs": None, "finish_reason": None}]}
                if want_ids and i == 0:
                    chunk["prompt_token_ids"] = prompt
                yield _sse(chunk)
            chunks = self.engine.stream(prompt, params, adapter=self.adapter(body))
            async with contextlib.aclosing(chunks) as stream:
                async for deltas in stream:
                    for d in deltas:
                        generated += len(d.token_ids)
                        choice = self._chat_delta(d, states, want_ids, want_lps)
                        yield _sse({**head, "choices": [choice]})
            if want_usage:
                yield _sse({**head, "choices": [], "usage": _usage(len(prompt), generated)})
        except (EngineError, ValueError) as e:
            yield _sse(_error_body(str(e), "api_error", 500))
        yield b"data: [DONE]\n\n"

    def _chat_delta(
        self, d: Choice, states: list[ToolStream], want_ids: bool, want_lps: bool
    ) -> dict[str, Any]:
        state = states[d.index]
        content, calls = state.feed(d.text, final=d.finish_reason is not None)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        finish: str | None = d.finish_reason
        if calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
            finish = "tool_calls"
        choice: dict[str, Any] = {"index": d.index, "delta": delta, "logprobs": None}
        if want_lps:
            values = self._values(d.logprobs, d.sampling_logprobs)
            choice["logprobs"] = self.chat_logprobs(d.token_ids, values, d.top_logprobs)
        choice["finish_reason"] = finish
        if finish is not None:
            choice["stop_reason"] = d.stop_reason
        if want_ids:
            choice["token_ids"] = d.token_ids
        return choice

    # ---- completions ---------------------------------------------------------------------
    async def completions(self, body: dict[str, Any]) -> dict[str, Any] | StreamingResponse:
        params = self.sampling(body, chat=False)
        prompts = self.completion_prompts(body)
        for prompt in prompts:
            self.check(prompt, params)
        want_ids, want_lps = bool(body.get("return_token_ids")), body.get("logprobs") is not None
        if body.get("stream"):
            return _EventStream(self.completions_stream(body, prompts, params, want_ids, want_lps))
        adapter = self.adapter(body)
        outs = await asyncio.gather(
            *(self.engine.generate(p, params, adapter=adapter) for p in prompts)
        )
        choices = []
        for k, out in enumerate(outs):
            for c in out.choices:
                choice: dict[str, Any] = {
                    "index": k * params.n + c.index,
                    "text": c.text,
                    "logprobs": self._choice_logprobs(c, False) if want_lps else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if want_ids:
                    choice["prompt_token_ids"] = out.prompt_token_ids
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
        resp = {**self.head("cmpl", "text_completion", body), "choices": choices}
        generated = sum(len(c.token_ids) for out in outs for c in out.choices)
        resp["usage"] = _usage(sum(len(p) for p in prompts), generated)
        return resp

    async def completions_stream(
        self,
        body: dict[str, Any],
        prompts: list[list[int]],
        params: SamplingParams,
        want_ids: bool,
        want_lps: bool,
    ) -> AsyncGenerator[bytes, None]:
        head = self.head("cmpl", "text_completion", body)
        opts = body.get("stream_options")
        want_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        queue: asyncio.Queue[tuple[int, list[Choice]] | BaseException | None] = asyncio.Queue()

        async def pump(k: int, prompt: list[int]) -> None:
            try:
                chunks = self.engine.stream(prompt, params, adapter=self.adapter(body))
                async with contextlib.aclosing(chunks) as stream:
                    async for deltas in stream:
                        queue.put_nowait((k, deltas))
            except Exception as e:
                queue.put_nowait(e)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(k, p)) for k, p in enumerate(prompts)]
        offsets = [0] * (len(prompts) * params.n)
        started: set[int] = set()
        generated, running = 0, len(tasks)
        try:
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                k, deltas = item
                for d in deltas:
                    index = k * params.n + d.index
                    generated += len(d.token_ids)
                    choice: dict[str, Any] = {"index": index, "text": d.text, "logprobs": None}
                    if want_lps:
                        values = self._values(d.logprobs, d.sampling_logprobs)
                        choice["logprobs"] = self.completion_logprobs(
                            d.token_ids, values, d.top_logprobs, offsets[index]
                        )
                    offsets[index] += len(d.text)
                    choice["finish_reason"] = d.finish_reason
                    choice["stop_reason"] = d.stop_reason
                    if want_ids:
                        choice["token_ids"] = d.token_ids
                        if index not in started:
                            choice["prompt_token_ids"] = prompts[k]
                    started.add(index)
                    yield _sse({**head, "choices": [choice]})
            if want_usage:
                usage = _usage(sum(len(p) for p in prompts), generated)
                yield _sse({**head, "choices": [], "usage": usage})
        except (EngineError, ValueError) as e:
            yield _sse(_error_body(str(e), "api_error", 500))
        finally:
            for task in tasks:
                task.cancel()
        yield b"data: [DONE]\n\n"

    def models(self) -> dict[str, Any]:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "voltrl",
            "root": self.model_name,
            "max_model_len": self.engine.max_model_len,
        }
        adapters = [
            {**card, "id": name, "root": name, "parent": self.model_name}
            for name in sorted(self.engine.adapters)
        ]
        return {"object": "list", "data": [card, *adapters]}


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_TOP_LOGPROBS


def _default(body: dict[str, Any], name: str, value: Any) -> Any:
    got = body.get(name)
    return value if got is None else got


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events from an async generator that is closed however the response ends (a
    client disconnect included), so that the engine drops its sequences at once."""

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with contextlib.aclosing(self.events):
            await super().__call__(scope, receive, send)


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """What ``work`` returns, unless the client disconnects first: then ``work`` is cancelled
    (its sequences leave the engine's batch) and the answer is a 499 nobody reads."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # a no-op once it is done
    return task.result() if task in done else Response(status_code=499)


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (call it once the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def create_app(
    engine: Engine, *, model_name: str = "voltrl-local", logprobs_mode: LogprobsMode = "raw"
) -> FastAPI:
    """The OpenAI-compatible FastAPI app serving ``engine`` (started here) as ``model_name``.

    Mount it or run it with :func:`serve_engine` / :func:`serve_engine_in_thread`; closing the
    engine stays the caller's job.
    """
    if logprobs_mode not in ("raw", "processed"):
        raise ValueError(f"logprobs_mode must be 'raw' or 'processed', not {logprobs_mode!r}")
    engine.start()
    server = _Server(engine, model_name, logprobs_mode)
    app = FastAPI(title="VoltRL local engine", docs_url=None, redoc_url=None)
    app.state.engine_server = server

    async def handle(request: Request, fn: Callable[[dict[str, Any]], Awaitable[Any]]) -> Any:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            return JSONResponse(
                _error_body(f"invalid JSON body: {e}", "invalid_request_error", 400), 400
            )
        if not isinstance(body, dict):
            return JSONResponse(
                _error_body("the body must be a JSON object", "invalid_request_error", 400), 400
            )
        try:
            return await _unless_disconnected(request, fn(body))
        except BadRequest as e:
            return JSONResponse(_error_body(e.message, "invalid_request_error", 400, e.param), 400)
        except EngineError as e:
            return JSONResponse(_error_body(str(e), "api_error", 503), 503)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await handle(request, server.chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, server.completions)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.running
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, 200 if ok else 503)

    return app


async def serve_engine(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    model_name: str = "voltrl-local",
    logprobs_mode: LogprobsMode = "raw",
    log_level: str = "warning",
    token: str | None = None,
) -> tuple[str, Callable[[], Awaitable[None]]]:
    """Serve ``engine`` on the running event loop (``port=0``: a free port).

    With a ``token`` every route but ``/health`` requires ``Authorization: Bearer <token>``
    (clients pass it as their API key). Returns the server's base URL (the OpenAI base URL is
    that plus ``/v1``) and an async ``stop``; see :func:`voltrl._http.serving.serve`.
    """
    app: ASGIApp = create_app(engine, model_name=model_name, logprobs_mode=logprobs_mode)
    if token:
        from voltrl._http.auth import BearerAuth

        app = BearerAuth(app, token, open_paths=("/health",))
    return await serve(app, host, port, log_level=log_level)


def serve_engine_in_thread(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    model_name: str = "voltrl-local",
    logprobs_mode: LogprobsMode = "raw",
    log_level: str = "warning",
) -> BackgroundServer:
    """Serve ``engine`` from a background thread (:func:`voltrl._http.serving.serve_in_thread`)."""
    app = create_app(engine, model_name=model_name, logprobs_mode=logprobs_mode)
    return serve_in_thread(app, host, port, log_level=log_level)
