"""How the gateway turns what a backend returned into LLMCall records, and what the client sees.

A backend answers a proxied call with token ids and logprobs the gateway asked for on the
client's behalf. :func:`_calls_from_response` turns a non-streamed response into one
:class:`~voltrl.types.LLMCall` per choice; :class:`_StreamAccumulator` rebuilds that response
from SSE chunks so a streamed call is recorded the same way; :func:`_strip` removes the extra
fields the client did not request before the response (or chunk) is relayed to it.
:class:`_Call` is what one proxied request is about, as these need it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from voltrl.types import LLMCall


@dataclass(slots=True)
class _Call:
    """What one proxied request is about: where to record it and what the client wants back."""

    kind: str  # "chat" or "completions"
    rollout_id: str
    attempt_id: str
    agent_name: str | None
    body: dict[str, Any]
    wants_ids: bool
    wants_logprobs: bool
    wants_usage: bool


def _logprob_values(kind: str, logprobs: Any) -> list[float] | None:
    if not isinstance(logprobs, dict):
        return None
    if kind == "chat":
        content = logprobs.get("content")
        return None if content is None else [e.get("logprob") for e in content]
    values = logprobs.get("token_logprobs")
    return None if values is None else list(values)


def _calls_from_response(
    call: _Call, data: dict[str, Any], meta: tuple[str, int | None, float]
) -> list[LLMCall]:
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


def _strip(call: _Call, data: dict[str, Any]) -> None:
    """Remove what the gateway asked for and the client did not (in place)."""
    if not call.wants_ids:
        data.pop("prompt_token_ids", None)
    for choice in data.get("choices") or ():
        if not call.wants_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if not call.wants_logprobs and "logprobs" in choice:
            choice["logprobs"] = None


class _StreamAccumulator:
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

    def calls(self, call: _Call, meta: tuple[str, int | None, float]) -> list[LLMCall]:
        """One finished response per choice, recorded like a non-streamed one."""
        choices = []
        for index in sorted(self.choices):
            st = self.choices[index]
            choice: dict[str, Any] = {"index": index, "finish_reason": st["finish"]}
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
        out = _calls_from_response(call, data, meta)
        for rec in out:
            rec.response_logprobs = self.choices[rec.choice_index]["lps"]
        return out
