"""Hermes-format tool calls in model output: :func:`parse_tool_calls` splits finished text into
content and OpenAI ``tool_calls``; :class:`ToolStream` streams a choice's content while holding
back what may turn out to be a tool call.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

_TOOL_OPEN = "<tool_call>"
_TOOL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split model output into content and OpenAI ``tool_calls`` (Hermes format).

    Each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` becomes a call with a
    fresh id and JSON-string arguments; an unterminated last ``<tool_call>`` counts too. The
    content is the text before the first call, right-stripped (``None`` if empty). If any call
    is malformed, nothing is parsed: ``(text, [])``.
    """
    start = text.find(_TOOL_OPEN)
    if start < 0:
        return text, []
    calls = []
    for match in _TOOL_RE.finditer(text):
        raw = match.group(1) if match.group(1) is not None else match.group(2)
        try:
            obj = json.loads(raw)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                json.loads(args)
            except ValueError:
                return text, []
        elif isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        else:
            return text, []
        fn = {"name": obj["name"], "arguments": args}
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": fn})
    return text[:start].rstrip() or None, calls


class ToolStream:
    """Streams a choice's content while holding back what may turn out to be a tool call."""

    def __init__(self, tools: bool) -> None:
        self.tools, self.text, self.sent, self.in_call = tools, "", 0, False

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """New content to send, and the parsed tool calls once ``final``."""
        if not self.tools:
            return text, []
        self.text += text
        if final:
            content, calls = parse_tool_calls(self.text)
            end = len(content or "") if calls else len(self.text)
            out, self.sent = self.text[self.sent : max(end, self.sent)], end
            return out, calls
        if not self.in_call:
            start = self.text.find(_TOOL_OPEN)
            self.in_call = start >= 0
            safe = start if self.in_call else len(self.text) - _partial_suffix(self.text)
            end = len(self.text[:safe].rstrip())
            if end > self.sent:
                out, self.sent = self.text[self.sent : end], end
                return out, []
        return "", []


def _partial_suffix(text: str) -> int:
    """Length of the longest end of ``text`` that begins ``<tool_call>``."""
    for k in range(min(len(_TOOL_OPEN) - 1, len(text)), 0, -1):
        if _TOOL_OPEN.startswith(text[-k:]):
            return k
    return 0
