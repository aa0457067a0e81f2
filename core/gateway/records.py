"""Recording: what a backend returned, as the LLMCall records the gateway writes to the store.

A backend answers a proxied call with token ids and logprobs the gateway asked for on the
client's behalf. :func:`calls_from_response` turns a non-streamed response into one
:class:`~voltrl.types.LLMCall` per choice; :class:`StreamAccumulator` rebuilds that response
from SSE chunks so a streamed call is recorded the same way; :func:`strip_extras` removes the
extra fields the client did not request before the response (or chunk) is relayed to it.
:class:`Call` is what one proxied request is about, as these need it. :class:`Recorder` writes
the records (and the spans of refused calls), awaited or in the background.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from voltrl.gateway.errors import GatewayHTTPError
from voltrl.store.base import Store
from voltrl.types import ABANDONED, ABANDONED_SPAN, REFUSED_SPAN, LLMCall, Span

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Call:
    """What one proxied request is about: where to record it and what the client wants back."""

    kind: str  # "chat" or "completions"
    rollout_id: str
    attempt_id: str
    agent_name: str | None
    body: dict[str, Any]
    wants_ids: bool
    wants_logprobs: bool
    wants_usage: bool


Meta = tuple[str, int | None, float]
"""Where and when a call was served: the backend's URL, the resources version, the start time."""


def _logprob_values(kind: str, logprobs: Any) -> list[float] | None:
    if not isinstance(logprobs, dict):
        return None
    if kind == "chat":
        content = logprobs.get("content")
        return None if content is None else [e.get("logprob") for e in content]
    values = logprobs.get("token_logprobs")
    return None if values is None else list(values)


def calls_from_response(call: Call, data: dict[str, Any], meta: Meta) -> list[LLMCall]:
    """One record per choice of a backend's (non-streamed) ``data`` for ``call``."""
    backend, version, started = meta
    ended = time.time()
    top_prompt = data.get("prompt_token_ids")
    shell = {k: v for k, v in data.items() if k not in ("choices", "prompt_token_ids")}
    out = []
    for choice in data.get("choices") or []:
        prompt_ids = choice.get("prompt_token_ids", top_prompt)
        stored = {k: v for k, v in choice.items() if k not in ("token_ids", "prompt_token_ids")}
        if not call.wants_logprobs:
            stored["logprobs"] = None
        out.append(
            LLMCall(
                rollout_id=call.rollout_id,
                attempt_id=call.attempt_id,
                agent_name=call.agent_name,
                request=call.body,
                response={**shell, "choices": [stored]},
                choice_index=choice.get("index", len(out)),
                prompt_token_ids=prompt_ids,
                response_token_ids=choice.get("token_ids"),
                response_logprobs=_logprob_values(call.kind, choice.get("logprobs")),
                finish_reason=choice.get("finish_reason"),
                backend=backend,
                model=data.get("model") or call.body.get("model"),
                resources_version=version,
                started_at=started,
                ended_at=ended,
            )
        )
    return out


def strip_extras(call: Call, data: dict[str, Any]) -> None:
    """Remove what the gateway asked for and the client did not (in place)."""
    if not call.wants_ids:
        data.pop("prompt_token_ids", None)
    for choice in data.get("choices") or ():
        if not call.wants_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if not call.wants_logprobs and "logprobs" in choice:
            choice["logprobs"] = None


class StreamAccumulator:
    """Rebuilds a non-streamed response, per choice, from streamed chunks."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.chunks = 0
        self.head: dict[str, Any] = {}
        self.prompt_ids: list[int] | None = None
        self.choices: dict[int, dict[str, Any]] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        self.chunks += 1
        if not self.head:
            self.head = {k: chunk.get(k) for k in ("id", "created", "model")}
        if chunk.get("usage") is not None:
            self.head["usage"] = chunk["usage"]
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_ids = chunk["prompt_token_ids"]
        for ch in chunk.get("choices") or ():
            st = self.choices.get(ch.get("index", 0))
            if st is None:
                st = self.choices[ch.get("index", 0)] = {
                    "text": [],
                    "reasoning": [],
                    "role": None,
                    "tools": {},
                    "ids": None,
                    "lps": None,
                    "prompt_ids": None,
                    "finish": None,
                    "stop_reason": None,
                }
            if ch.get("prompt_token_ids") is not None:
                st["prompt_ids"] = ch["prompt_token_ids"]
            if ch.get("token_ids") is not None:
                st["ids"] = (st["ids"] or []) + list(ch["token_ids"])
            lps = _logprob_values(self.kind, ch.get("logprobs"))
            if lps is not None:
                st["lps"] = (st["lps"] or []) + lps
            if ch.get("finish_reason") is not None:
                st["finish"] = ch["finish_reason"]
            if ch.get("stop_reason") is not None:
                st["stop_reason"] = ch["stop_reason"]
            if self.kind == "completions":
                st["text"].append(ch.get("text") or "")
                continue
            delta = ch.get("delta") or {}
            st["role"] = st["role"] or delta.get("role")
            if delta.get("content"):
                st["text"].append(delta["content"])
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                st["reasoning"].append(reasoning)
            for tc in delta.get("tool_calls") or ():
                slot = st["tools"].setdefault(
                    tc.get("index", 0),
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                slot["id"] = tc.get("id") or slot["id"]
                slot["type"] = tc.get("type") or slot["type"]
                fn = tc.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""

    def calls(self, call: Call, meta: Meta, *, cut: bool = False) -> list[LLMCall]:
        """One response per choice, recorded like a non-streamed one; of a stream ``cut``
        short, a choice that had not finished gets the finish reason
        :data:`~voltrl.types.ABANDONED`."""
        choices = []
        for index in sorted(self.choices):
            st = self.choices[index]
            finish = st["finish"] or (ABANDONED if cut else None)
            choice: dict[str, Any] = {"index": index, "finish_reason": finish}
            if st["stop_reason"] is not None:
                choice["stop_reason"] = st["stop_reason"]
            if self.kind == "completions":
                choice["text"] = "".join(st["text"])
            else:
                message: dict[str, Any] = {
                    "role": st["role"] or "assistant",
                    "content": "".join(st["text"]) if st["text"] or not st["tools"] else None,
                }
                if st["reasoning"]:
                    message["reasoning_content"] = "".join(st["reasoning"])
                if st["tools"]:
                    message["tool_calls"] = [st["tools"][k] for k in sorted(st["tools"])]
                choice["message"] = message
            choice["logprobs"] = None
            choice["token_ids"] = st["ids"]
            if st["prompt_ids"] is not None:
                choice["prompt_token_ids"] = st["prompt_ids"]
            choices.append(choice)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        data = {**self.head, "object": obj, "choices": choices, "prompt_token_ids": self.prompt_ids}
        out = calls_from_response(call, data, meta)
        for rec in out:
            rec.response_logprobs = self.choices[rec.choice_index]["lps"]
        return out


class Recorder:
    """Writes the gateway's records to ``store``, keeping the background writes so that
    :meth:`wait` can see them finish."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._writes: set[asyncio.Task[Any]] = set()

    async def record(self, calls: list[LLMCall]) -> None:
        """Write the calls; the write finishes even if this request is cancelled meanwhile."""
        task = self._track(self.store.add_llm_calls(calls))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise GatewayHTTPError(
                500, f"the call could not be recorded: {type(e).__name__}: {e}", type="api_error"
            ) from e

    def record_later(self, calls: list[LLMCall]) -> None:
        """Write the calls in the background (:meth:`wait` waits for them); failures are
        logged, as there is no response left to report them in."""
        self._track(self.store.add_llm_calls(calls)).add_done_callback(_log_write_failure)

    def record_refusal(self, call: Call, error: GatewayHTTPError, started: float) -> None:
        """Record a call the backend refused (a prompt over the context, a bad parameter) as
        a ``gateway.refused`` span of its attempt, which the trajectory builder counts
        (``refused/<code>``); written in the background, like late call records."""
        self._record_span(
            call,
            REFUSED_SPAN,
            started,
            {
                "http.response.status_code": error.status,
                "error.type": error.code or error.type,
                "error.message": error.message[:1000],
            },
        )

    def record_abandoned(self, call: Call, reason: str, started: float) -> None:
        """Record a call cut off in flight (``reason``: one of
        :data:`~voltrl.gateway.drain.CUT_REASONS`) as a ``gateway.abandoned`` span of its
        attempt, which the trajectory builder counts (``abandoned/<reason>``); written in
        the background."""
        self._record_span(call, ABANDONED_SPAN, started, {"voltrl.cut_reason": reason})

    def _record_span(
        self, call: Call, name: str, started: float, attributes: dict[str, Any]
    ) -> None:
        """An error span of the call's attempt, from ``started`` to now, with its agent."""
        span = Span(
            rollout_id=call.rollout_id,
            attempt_id=call.attempt_id,
            name=name,
            start_time=started,
            end_time=time.time(),
            status="error",
            attributes={**attributes, "voltrl.agent_name": call.agent_name or ""},
        )
        self._track(self.store.add_spans([span])).add_done_callback(_log_write_failure)

    async def wait(self) -> None:
        """Return once every write started so far (and any started meanwhile) has finished."""
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    def _track(self, write: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(write)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return task


def _log_write_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("gateway: LLM calls could not be recorded", exc_info=task.exception())
