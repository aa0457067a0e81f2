"""A request as the engine thread holds it: each choice's tokens, its text, when it stops.

A :class:`Request` is shared between the event loop that submitted it and the engine thread;
each of its ``n`` choices is a :class:`Seq`, one row of the running batch. A sampled token is
appended to its :class:`Seq`, which detokenises it incrementally and checks the stop
conditions; :meth:`Seq.take_delta` is what the request's loop gets next.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from voltrl.serving.engine.sampling import (
    Choice,
    FinishReason,
    SamplingParams,
    decode_increment,
    find_stop,
)


class EngineError(RuntimeError):
    """The engine failed a request: closed, or the model raised while serving it."""


UPDATE_TIMEOUT_S = 600.0
"""How long a weight update may wait for the engine thread to load it (a bound: the gateway
stays paused meanwhile)."""


def wait_for_update(
    done: threading.Event, thread: threading.Thread, timeout_s: float = UPDATE_TIMEOUT_S
) -> None:
    """Wait until the engine thread has loaded (or failed) a weight update it was handed:
    :class:`EngineError` when the thread ended without saying, or after ``timeout_s``, so a
    weight swap never waits for ever."""
    deadline = time.monotonic() + timeout_s
    while not done.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
        if not thread.is_alive() and not done.is_set():
            raise EngineError("the engine stopped before it loaded the new weights")
        if time.monotonic() >= deadline:
            raise EngineError(
                f"the engine did not load the new weights within {timeout_s:.0f} s (its thread "
                "is stuck); the run stops rather than serve unknown weights"
            )


def failure(e: Exception) -> EngineError:
    """The error a request gets when the model raised ``e`` while serving it."""
    error = EngineError(f"generation failed: {type(e).__name__}: {e}")
    error.__cause__ = e
    return error


BASE = "__base__"
"""peft's name for "no adapter" in a mixed-adapter batch."""


class Request:
    """A submitted request, shared between its event loop and the engine thread."""

    def __init__(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        max_tokens: int,
        adapter: str | None = None,
    ) -> None:
        self.id, self.prompt, self.params, self.max_tokens = rid, prompt, params, max_tokens
        self.adapter = adapter or BASE
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[list[Choice] | BaseException] = asyncio.Queue()
        self.aborted = False
        self.stops = list(params.stop)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.stop_ids = frozenset(params.stop_token_ids)

    def emit(self, item: list[Choice] | BaseException) -> None:
        """Hand ``item`` to the request's event loop (from the engine thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            self.aborted = True


def deliver(items: list[tuple[Request, list[Choice]]]) -> None:
    """On a request's event loop: queue each request's deltas."""
    for req, deltas in items:
        req.queue.put_nowait(deltas)


@dataclass(slots=True, eq=False)
class Seq:
    """One choice being generated: its tokens, logprobs and incremental detokenisation
    (``prefix``/``read`` window; ``sent`` characters and ``flushed`` tokens delivered)."""

    req: Request
    index: int
    gen: torch.Generator | None
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    slps: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    prefix: int = 0
    read: int = 0
    sent: int = 0
    flushed: int = 0
    finish: FinishReason | None = None
    stop_reason: str | int | None = None

    def append(
        self,
        token: int,
        lp: float,
        slp: float,
        top: list[tuple[int, float]],
        *,
        eos_token_ids: frozenset[int],
        tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        """Add a sampled token: detokenise, then check stop conditions. EOS and
        ``stop_token_ids`` tokens stay in ``ids`` (they were sampled, the trainer needs them)
        but not in the text; a stop string ends the choice and is cut from the text."""
        self.ids.append(token)
        self.lps.append(lp)
        self.slps.append(slp)
        self.tops.append(top)
        req, params = self.req, self.req.params
        if token in req.stop_ids or (token in eos_token_ids and not params.ignore_eos):
            self.finish = "stop"
            self.stop_reason = token if token in req.stop_ids else None
            self._detokenize(tokenizer, len(self.ids) - 1, final=True)  # the stop token: no text
            return
        start = len(self.text)
        final = len(self.ids) >= req.max_tokens
        self._detokenize(tokenizer, len(self.ids), final=final)
        if req.stops and len(self.text) > start:
            hit = find_stop(self.text, start, req.stops)
            if hit:
                cut, stop = hit
                self.text = self.text[:cut]
                self.finish, self.stop_reason = "stop", stop
                return
        if final:
            self.finish = "length"

    def _detokenize(self, tokenizer: PreTrainedTokenizerBase, end: int, *, final: bool) -> None:
        """Incremental decoding of ``ids[:end]`` over a short window. An incomplete UTF-8
        sequence at the end waits for the next token, unless ``final``."""
        skip = self.req.params.skip_special_tokens
        text = decode_increment(
            tokenizer, self.ids, self.prefix, self.read, end, skip_special_tokens=skip, final=final
        )
        if text:
            self.text += text
            self.prefix, self.read = self.read, end

    def take_delta(self) -> Choice | None:
        """What this choice added since the last delta (``None``: nothing yet), marked
        delivered. While it runs, text that may still start a stop string is held back."""
        if self.finish is None and self.flushed == len(self.ids):
            return None
        if self.finish is None:
            release = max(self.sent, len(self.text) - self.req.hold)
        else:
            release = len(self.text)
        delta = Choice(
            index=self.index,
            token_ids=self.ids[self.flushed :],
            logprobs=self.lps[self.flushed :],
            sampling_logprobs=self.slps[self.flushed :],
            top_logprobs=self.tops[self.flushed :],
            text=self.text[self.sent : release],
            finish_reason=self.finish,
            stop_reason=self.stop_reason,
        )
        self.flushed, self.sent = len(self.ids), release
        return delta
