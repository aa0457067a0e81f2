"""What every LocalRL engine offers its callers: requests in from any event loop, deltas out.

:class:`EngineFront` holds the request side that the built-in :class:`~.core.Engine` and the
vLLM-backed :class:`~.vllm.VLLMEngine` share: checking a request (:meth:`~EngineFront.check`),
streaming its deltas (:meth:`~EngineFront.stream`), collecting them
(:meth:`~EngineFront.generate`) and loading new weights without blocking the event loop
(:meth:`~EngineFront.aupdate_weights`). An engine supplies ``_submit`` (hand a
:class:`~.sequences.Request` to its thread), ``_abort`` (wake that thread when a caller stops
listening) and ``update_weights``, and the attributes :meth:`~EngineFront.check` reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Self

import torch
from torch import nn

from voltrl.serving.engine.sampling import Choice, RequestOutput, SamplingParams, is_int
from voltrl.serving.engine.sequences import Request


class EngineFront:
    """The request side of an engine (see the module docstring)."""

    tokenizer: Any
    adapters: frozenset[str]
    """The LoRA adapters requests may name (empty for a plain model)."""
    vocab_size: int
    max_model_len: int
    max_batch_size: int
    weights_version: int
    processed_logprobs: bool = True
    """Whether deltas carry the sampling (processed) logprobs as well as the raw ones."""

    def start(self) -> Self:
        raise NotImplementedError

    def close(self, timeout_s: float = 30.0) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(
        self, prompt: list[int], params: SamplingParams, rid: str | None, adapter: str | None
    ) -> Request:
        raise NotImplementedError

    def _abort(self, req: Request) -> None:
        raise NotImplementedError

    def update_weights(
        self,
        weights: Mapping[str, torch.Tensor] | nn.Module,
        *,
        strict: bool = True,
        adapter: str | None = None,
    ) -> int:
        raise NotImplementedError

    def stream(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        adapter: str | None = None,
    ) -> AsyncIterator[list[Choice]]:
        """Submit a request now; iterate the result for each step's deltas (one per choice
        that changed) until all ``n`` choices have a ``finish_reason``. Call it on the event
        loop that will iterate it; closing the iterator early aborts the request.
        ``adapter``: the LoRA adapter generating it (None: the base model).

        Raises ``ValueError`` at once for a bad prompt, bad parameters or an unknown adapter
        (see :meth:`check`); the iteration raises ``EngineError`` if the engine is closed or
        the model fails.
        """
        req = self._submit(list(prompt_token_ids), params or SamplingParams(), request_id, adapter)
        return self._iterate(req)

    async def _iterate(self, req: Request) -> AsyncIterator[list[Choice]]:
        left = req.params.n
        try:
            while left:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                left -= sum(d.finish_reason is not None for d in item)
                yield item
        finally:
            if left:
                req.aborted = True
                self._abort(req)

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        adapter: str | None = None,
    ) -> RequestOutput:
        """Generate all ``n`` choices of one prompt (with ``adapter``, as :meth:`stream`)
        and return them when finished."""
        params = params or SamplingParams()
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        choices = [Choice(index=i) for i in range(params.n)]
        stream = self.stream(prompt_token_ids, params, request_id=rid, adapter=adapter)
        async with contextlib.aclosing(stream) as it:
            async for deltas in it:
                for d in deltas:
                    choices[d.index].add(d)
        return RequestOutput(rid, list(prompt_token_ids), choices)

    def check(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, adapter: str | None = None
    ) -> int:
        """Validate a request without submitting it; return how many tokens it may generate.

        Raises ``ValueError`` with a message fit for the caller (an HTTP 400).
        """
        params.validate()
        if adapter is not None and adapter not in self.adapters:
            served = ", ".join(sorted(self.adapters)) or "none"
            raise ValueError(f"no LoRA adapter {adapter!r} (adapters served: {served})")
        prompt = prompt_token_ids
        if not prompt:
            raise ValueError("the prompt is empty")
        if any(not is_int(t) or not 0 <= t < self.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; this model's context is "
                f"{self.max_model_len} tokens, so at most {self.max_model_len - 1} fit"
            )
        room = self.max_model_len - len(prompt)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} with a {len(prompt)}-token prompt exceeds the "
                f"context of {self.max_model_len} tokens (at most {room} can be generated)"
            )
        if params.n > self.max_batch_size:
            raise ValueError(f"n={params.n} exceeds the engine's batch size {self.max_batch_size}")
        return params.max_tokens or room

    async def aupdate_weights(
        self,
        weights: Mapping[str, torch.Tensor] | nn.Module,
        *,
        strict: bool = True,
        adapter: str | None = None,
    ) -> int:
        """:meth:`update_weights` without blocking the event loop."""
        return await asyncio.to_thread(self.update_weights, weights, strict=strict, adapter=adapter)
