"""The reasoning split: thinking text a model wrote into its content, moved to
``reasoning_content``.

Reasoning models (Qwen3, DeepSeek-R1 and their distills) write ``<think>...</think>`` before
the answer; some backends return it inside ``content``, and agent frameworks then show it to
other agents, store it in their memory and parse it as the answer. With the split on, the
gateway hands the agent ``reasoning_content`` (the thinking) and ``content`` (the rest), the
way vLLM's reasoning parsers do, while the call it records keeps the response exactly as
sampled (token ids, text), so training is unaffected.

The rule, the same for whole responses and streams: when the text contains ``</think>``,
what comes before it (without a leading ``<think>``) is the reasoning and what follows (without
leading whitespace) the content; otherwise it is all content. A template that opens the
``<think>`` in the prompt is covered by the same rule.
"""

from __future__ import annotations

from typing import Any

OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a whole response's text (reasoning None: there was none)."""
    head, sep, tail = text.partition(CLOSE)
    if sep:
        return head.lstrip().removeprefix(OPEN), tail.lstrip()
    if text.lstrip().startswith(OPEN):  # cut off while thinking: no answer yet
        return text.lstrip()[len(OPEN) :], ""
    return None, text


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """:func:`split_reasoning` for one streamed choice: ``feed`` each content delta, get the
    ``(reasoning, content)`` to send now; ``finish`` at the end gives what was held back. The
    pieces add up to what :func:`split_reasoning` gives for the whole text.

    A stream that opens with ``<think>`` streams its reasoning as it comes. Otherwise the
    text is held back until ``</think>`` shows it was reasoning, or the stream ends and it was
    content after all (a model that does not think then gets its answer in one piece)."""

    def __init__(self) -> None:
        self.state = "start"  # start -> think | maybe -> answer; "off": the backend splits
        self.buffer = ""
        self.answering = False  # content sent: no more leading whitespace to drop

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content to send for this delta (either may be empty)."""
        self.buffer += text
        reasoning = ""
        if self.state == "start":
            stripped = self.buffer.lstrip()
            if not stripped or (OPEN.startswith(stripped) and stripped != OPEN):
                return "", ""  # could still become <think>
            if stripped.startswith(OPEN):
                self.state, self.buffer = "think", stripped[len(OPEN) :]
            else:
                self.state = "maybe"
        if self.state in ("think", "maybe"):
            head, sep, tail = self.buffer.partition(CLOSE)
            if sep:
                reasoning = head if self.state == "think" else head.lstrip()
                self.state, self.buffer = "answer", tail
            elif self.state == "maybe":
                return "", ""
            else:
                keep = len(self.buffer) - _held_back(self.buffer, CLOSE)
                reasoning, self.buffer = self.buffer[:keep], self.buffer[keep:]
                return reasoning, ""
        return reasoning, self._answer()

    def _answer(self) -> str:
        if not self.answering:
            self.buffer = self.buffer.lstrip()
            self.answering = bool(self.buffer)
        out, self.buffer = self.buffer, ""
        return out

    def finish(self) -> tuple[str, str]:
        """What is still held back when the stream ends."""
        if self.state == "think":  # cut off while thinking
            rest, self.buffer = self.buffer, ""
            return rest, ""
        if self.state == "answer":
            return "", self._answer()
        rest, self.buffer = self.buffer, ""
        return "", rest


def split_messages(data: dict[str, Any]) -> None:
    """Move each message's thinking in a chat completion to ``reasoning_content`` (the
    choices get new message objects), unless the backend already split it."""
    for choice in data.get("choices") or ():
        message = choice.get("message") or {}
        text = message.get("content")
        if isinstance(text, str) and not message.get("reasoning_content"):
            reasoning, content = split_reasoning(text)
            if reasoning is not None:  # a new message: the recorded call may share this one
                choice["message"] = {
                    **message,
                    "content": content,
                    "reasoning_content": reasoning,
                }


def split_deltas(chunk: dict[str, Any], split: dict[int, ReasoningSplitter]) -> None:
    """The same for one streamed chunk (in place): each choice's content delta goes through
    its splitter, and a choice's last chunk also carries what the splitter held back. A
    choice whose backend already sends ``reasoning_content`` is passed through as it is."""
    for choice in chunk.get("choices") or ():
        splitter = split.setdefault(choice.get("index", 0), ReasoningSplitter())
        delta = choice.setdefault("delta", {})
        if not isinstance(delta, dict) or splitter.state == "off":
            continue
        reasoning, content = "", ""
        if delta.get("reasoning_content") or delta.get("reasoning"):
            reasoning, content = splitter.finish()  # the backend splits: stop splitting
            splitter.state = "off"
            content += delta.get("content") or ""
        elif isinstance(delta.get("content"), str):
            reasoning, content = splitter.feed(delta["content"])
        if choice.get("finish_reason") is not None:
            more_reasoning, more_content = splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if content or isinstance(delta.get("content"), str):
            delta["content"] = content
        if reasoning:
            delta["reasoning_content"] = (delta.get("reasoning_content") or "") + reasoning


def flush_deltas(split: dict[int, ReasoningSplitter], head: dict[str, Any]) -> dict | None:
    """A last chunk with what the splitters still hold when a stream ends without each
    choice's ``finish_reason`` (None: nothing held). ``head``: the stream's id, created and
    model."""
    choices = []
    for index, splitter in sorted(split.items()):
        if splitter.state == "off":
            continue
        reasoning, content = splitter.finish()
        delta = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
        if delta:
            choices.append({"index": index, "delta": delta, "finish_reason": None})
    if not choices:
        return None
    ids = {k: head.get(k) for k in ("id", "created", "model")}
    return {**ids, "object": "chat.completion.chunk", "choices": choices}
