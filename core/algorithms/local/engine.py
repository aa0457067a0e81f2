"""A small continuous-batching inference engine for a Hugging Face causal LM (CPU or one GPU).

The model runs on one dedicated thread. Requests arrive from any event loop
(:meth:`Engine.stream`, :meth:`Engine.generate`) and join the running batch at the next step
boundary: their prompts are prefilled together (left-padded, with attention masks and position
ids), each prompt's KV cache is repeated for its ``n`` choices, and the rows are merged into the
batch's ``DynamicCache``. Every step then decodes one token for every running choice in one
forward pass; finished choices leave the batch at once and the cache's all-padding columns are
trimmed.

Requests are described by :class:`~.sampling.SamplingParams` and answered with
:class:`~.sampling.Choice` deltas and :class:`~.sampling.RequestOutput`s (re-exported here);
:mod:`.sampling` samples the tokens and documents the ``logprobs`` / ``sampling_logprobs``
semantics.

Text follows vLLM: special tokens are skipped, a stop string ends generation and is cut from the
text (with the rest of the text after it), and EOS / ``stop_token_ids`` tokens are kept in
``token_ids`` (they were sampled, the trainer needs them) but not in the text.

:meth:`Engine.update_weights` swaps weights at a step boundary; choices in flight go on with
the new weights (their cached keys and values stay), and each delta records the
``weights_version`` that sampled it.

**LoRA adapters.** Given a ``peft`` model holding several LoRA adapters (one per agent role)
and ``lora_adapters=True``, the engine serves them all at once: each request names its adapter
(``adapter=``; None: the base model), and requests for different adapters share one decode
batch: a forward pass runs the base weights once for every row and each adapter's low-rank
update on its own rows (peft's mixed-adapter batches). ``update_weights(state,
adapter=name)`` swaps one adapter's weights and leaves the others, and the base, as they are.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import secrets
import threading
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from voltrl.algorithms.local.lora_adapters import adapter_key, adapter_of
from voltrl.algorithms.local.loss import cache_keyword
from voltrl.algorithms.local.sampling import (
    MAX_TOP_LOGPROBS,
    Choice,
    FinishReason,
    RequestOutput,
    SamplingParams,
    _is_int,
    decode_increment,
    find_stop,
    sample,
)
from voltrl.algorithms.local.threads import decide_threads, use_threads

__all__ = [
    "MAX_TOP_LOGPROBS",
    "Choice",
    "Engine",
    "EngineError",
    "FinishReason",
    "RequestOutput",
    "SamplingParams",
]


class EngineError(RuntimeError):
    """The engine failed a request: closed, or the model raised while serving it."""


BASE = "__base__"
"""peft's name for "no adapter" in a mixed-adapter batch."""


class _Request:
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


@dataclass(slots=True, eq=False)
class _Seq:
    """One choice being generated: its tokens, logprobs and incremental detokenisation
    (``prefix``/``read`` window; ``sent`` characters and ``flushed`` tokens delivered)."""

    req: _Request
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


class Engine:
    """Continuous-batching generation for a causal LM, on its own thread.

    Args:
        model: a Hugging Face causal LM whose cache layers are full-attention
            ``DynamicLayer``s (Llama, Qwen2, Mistral without sliding window, ...), or a
            ``peft`` model of one.
        tokenizer: its tokenizer (for detokenisation and stop strings).
        max_batch_size: most choices decoded together; more requests wait their turn.
        max_prefill_tokens: most padded prompt tokens prefilled in one step (at least one
            request is always admitted).
        max_model_len: context length (prompt + generated); defaults to the model's
            ``max_position_embeddings``.
        seed: seeds the sampling of requests that give no seed of their own.
        threads: torch intra-op threads of the engine thread (default: the count in effect
            in the thread that builds the engine, e.g. as LocalRL set it).
        lora_adapters: serve the ``peft`` model's LoRA adapters by name, unmerged (a request
            naming none gets the base model). Without it a peft model is served as it is,
            its active adapter applied to every request.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int = 64,
        max_prefill_tokens: int = 8192,
        max_model_len: int | None = None,
        seed: int | None = None,
        threads: int | None = None,
        lora_adapters: bool = False,
    ) -> None:
        self.model = model.eval()
        if lora_adapters and not getattr(model, "peft_config", None):
            raise ValueError("lora_adapters=True needs a peft model holding LoRA adapters")
        self.adapters = frozenset(model.peft_config if lora_adapters else ())
        """The LoRA adapters requests may name (empty for a plain model)."""
        self.adapter_versions = dict.fromkeys(sorted(self.adapters), 0)
        """Each adapter's weights version: its :meth:`update_weights` so far."""
        self._adapter_params: dict[str, dict[str, torch.Tensor]] = {a: {} for a in self.adapters}
        for name, p in model.named_parameters():  # each adapter's weights, keyed as peft saves them
            if (owner := adapter_of(name)) in self._adapter_params:
                self._adapter_params[owner][adapter_key(name)] = p
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        keyword = cache_keyword(model)
        if keyword is None:
            raise ValueError(
                f"{type(model).__name__}.forward takes no KV cache: the engine needs one"
            )
        self._cache_keyword = keyword
        self.max_batch_size = max_batch_size
        self.threads = torch.get_num_threads() if threads is None else decide_threads(threads)
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len or int(
            getattr(model.config, "max_position_embeddings", 0) or 4096
        )
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos_ids)
        pad = tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else min(eos_ids, default=0)
        self.weights_version = 0
        self.stats: collections.Counter[str] = collections.Counter()
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(seed if seed is not None else secrets.randbits(63))
        self._cv = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._updates: list[
            tuple[Mapping[str, torch.Tensor], bool, str | None, threading.Event, list]
        ] = []
        self._thread: threading.Thread | None = None
        self._closing = False
        # The running batch: its rows (one per choice), KV cache, left padding per row, cache
        # length, and each row's last sampled token (not yet in the cache).
        self._seqs: list[_Seq] = []
        self._cache: DynamicCache | None = None
        self._pad = torch.zeros(0, dtype=torch.long, device=self.device)
        self._len = 0
        self._padded = False  # whether any row has left padding (else no mask is needed)
        self._last = torch.zeros(0, dtype=torch.long, device=self.device)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> Engine:
        """Start the engine thread (submitting a request starts it too). Idempotent."""
        with self._cv:
            if self._closing:
                raise EngineError("the engine is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="voltrl-engine", daemon=True)
                self._thread.start()
        return self

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread after the current step; requests not finished get EngineError."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        """Whether the engine thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests -------------------------------------------------------------------------
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

    async def _iterate(self, req: _Request) -> AsyncIterator[list[Choice]]:
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
                with self._cv:
                    self._cv.notify_all()

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
        if any(not _is_int(t) or not 0 <= t < self.vocab_size for t in prompt):
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

    def _submit(
        self, prompt: list[int], params: SamplingParams, rid: str | None, adapter: str | None
    ) -> _Request:
        max_tokens = self.check(prompt, params, adapter)
        rid = rid or f"req-{uuid.uuid4().hex[:16]}"
        req = _Request(rid, prompt, params, max_tokens, adapter)
        self.start()
        with self._cv:
            self._waiting.append(req)
            self._cv.notify_all()
        return req

    # ---- weights --------------------------------------------------------------------------
    def update_weights(
        self,
        weights: Mapping[str, torch.Tensor] | nn.Module,
        *,
        strict: bool = True,
        adapter: str | None = None,
    ) -> int:
        """Load new weights (a state dict, or a module whose ``state_dict()`` matches) at the
        next step boundary and return the new ``weights_version``. With ``adapter``, only
        that LoRA adapter's weights, as ``peft``'s ``get_peft_model_state_dict`` gives them
        (every one of them, whatever ``strict``). Blocks until applied; call
        :meth:`aupdate_weights` from async code."""
        state = weights.state_dict() if isinstance(weights, nn.Module) else weights
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"no LoRA adapter {adapter!r} to update")
        if not self.running or threading.current_thread() is self._thread:
            self._load(state, strict, adapter)
            return self.weights_version
        done, box = threading.Event(), []
        with self._cv:
            if self._closing:
                raise EngineError("the engine is closed")
            self._updates.append((state, strict, adapter, done, box))
            self._cv.notify_all()
        done.wait()
        if box and isinstance(box[0], BaseException):
            raise box[0]
        return self.weights_version

    async def aupdate_weights(
        self,
        weights: Mapping[str, torch.Tensor] | nn.Module,
        *,
        strict: bool = True,
        adapter: str | None = None,
    ) -> int:
        """:meth:`update_weights` without blocking the event loop."""
        return await asyncio.to_thread(self.update_weights, weights, strict=strict, adapter=adapter)

    def _load(self, state: Mapping[str, torch.Tensor], strict: bool, adapter: str | None) -> None:
        with torch.no_grad():
            if adapter is None:
                self.model.load_state_dict(state, strict=strict)
            else:  # copied in place: no pass over the rest of the model
                params = self._adapter_params[adapter]
                if params.keys() != state.keys():
                    raise ValueError(
                        f"adapter {adapter!r}: the weights given do not match its parameters "
                        f"(missing {sorted(params.keys() - state.keys())[:3]}, unexpected "
                        f"{sorted(state.keys() - params.keys())[:3]})"
                    )
                for key, value in state.items():
                    params[key].copy_(value)
                self.adapter_versions[adapter] += 1
        self.weights_version += 1

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        use_threads(self.threads)
        new: list[_Request] = []
        try:
            while True:
                with self._cv:
                    while not (self._closing or self._waiting or self._seqs or self._updates):
                        self._cv.wait()
                    if self._closing:
                        break
                    updates, self._updates = self._updates, []
                    new = self._admit()
                for state, strict, adapter, done, box in updates:
                    try:
                        self._load(state, strict, adapter)
                    except BaseException as e:
                        box.append(e)
                    done.set()
                if new:
                    try:
                        with torch.inference_mode():
                            self._prefill(new)
                    except Exception as e:  # the running batch is untouched: fail the new ones
                        for req in new:
                            req.emit(_failure(e))
                    new = []
                if self._seqs:
                    try:
                        with torch.inference_mode():
                            self._flush()  # first tokens out at once; drops rows already done
                            if self._seqs:
                                self._decode()
                                self._flush()
                    except Exception as e:
                        for req in self._requests_of([]):
                            req.emit(_failure(e))
                        self._reset_batch()
        finally:  # closed, or a bug: no request may wait forever
            reason = "was closed" if self._closing else "stopped unexpectedly"
            error = EngineError(f"the engine {reason}")
            with self._cv:
                self._closing = True
                pending = [*new, *self._waiting]
                self._waiting.clear()
                for *_, done, box in self._updates:
                    box.append(error)
                    done.set()
            for req in self._requests_of(pending):
                req.emit(error)
            self._reset_batch()

    def _requests_of(self, extra: list[_Request]) -> list[_Request]:
        seen: dict[int, _Request] = {id(r): r for r in extra}
        for s in self._seqs:
            seen.setdefault(id(s.req), s.req)
        return list(seen.values())

    def _admit(self) -> list[_Request]:
        """Take waiting requests that fit the batch (called holding the lock)."""
        rows, new, longest = len(self._seqs), [], 0
        while self._waiting:
            req = self._waiting[0]
            if req.aborted:
                self._waiting.popleft()
                continue
            longest = max(longest, len(req.prompt))
            over = longest * (len(new) + 1) > self.max_prefill_tokens
            if rows + req.params.n > self.max_batch_size or (new and over):
                break
            self._waiting.popleft()
            new.append(req)
            rows += req.params.n
        return new

    def _reset_batch(self) -> None:
        self._seqs, self._cache, self._len, self._padded = [], None, 0, False
        self._pad = self._pad[:0]
        self._last = self._last[:0]

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor | None,
        pos: torch.Tensor,
        cache: DynamicCache,
        reqs: Sequence[_Request],
    ) -> torch.Tensor:
        """Next-token logits of each row; ``reqs``: each row's request (its adapter)."""
        adapters = {"adapter_names": [r.adapter for r in reqs]} if self.adapters else {}
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            **{self._cache_keyword: cache},
            logits_to_keep=1,
            **adapters,
        )
        return out.logits[:, -1].float()

    def _prefill(self, new: list[_Request]) -> None:
        """Run the new prompts together, sample each choice's first token, join the batch."""
        lengths = [len(r.prompt) for r in new]
        width = max(lengths)
        ids = torch.full((len(new), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(new), width), dtype=torch.long)
        for i, r in enumerate(new):
            ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self._forward(ids, mask, pos, cache, new)
        self.stats["prefill_tokens"] += sum(lengths)
        rows = [i for i, r in enumerate(new) for _ in range(r.params.n)]
        if rows != list(range(len(new))):
            index = torch.tensor(rows, device=self.device)
            for layer in cache.layers:
                layer.batch_select_indices(index)
            logits = logits[index]
        pad = torch.tensor([width - lengths[i] for i in rows], device=self.device)
        seqs = [_Seq(r, j, self._seq_generator(r, j)) for r in new for j in range(r.params.n)]
        tokens = self._sample(seqs, logits)
        self._join(seqs, cache, pad, width, tokens)

    def _seq_generator(self, req: _Request, index: int) -> torch.Generator | None:
        if req.params.seed is None or req.params.temperature == 0:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed((req.params.seed * 1_000_003 + index) % (2**63))
        return gen

    def _join(
        self,
        seqs: list[_Seq],
        cache: DynamicCache,
        pad: torch.Tensor,
        length: int,
        tokens: torch.Tensor,
    ) -> None:
        """Merge prefilled rows into the running batch, left-padding the shorter cache."""
        for layer in cache.layers:
            if type(layer).__name__ != "DynamicLayer":
                raise EngineError(
                    f"the engine supports full-attention DynamicLayer caches, not "
                    f"{type(layer).__name__} (sliding-window models are not supported)"
                )
        if self._cache is None:
            self._seqs, self._cache, self._pad, self._len = seqs, cache, pad, length
            self._last = tokens
            self._padded = bool(pad.any())
            return
        width = max(self._len, length)
        for old, add in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(add.keys, width)])
            old.values = torch.cat([_left_pad(old.values, width), _left_pad(add.values, width)])
        self._pad = torch.cat([self._pad + width - self._len, pad + width - length])
        self._len = width
        self._padded = bool(self._pad.any())
        self._seqs += seqs
        self._last = torch.cat([self._last, tokens])

    def _decode(self) -> None:
        """One forward pass for every running choice: feed its last token, sample the next."""
        assert self._cache is not None
        mask = None
        if self._padded:
            cols = torch.arange(self._len + 1, device=self.device)
            mask = (cols[None, :] >= self._pad[:, None]).long()
        pos = (self._len - self._pad)[:, None]
        reqs = [s.req for s in self._seqs]
        logits = self._forward(self._last[:, None], mask, pos, self._cache, reqs)
        self._len += 1
        self.stats["steps"] += 1
        self.stats["decode_tokens"] += len(self._seqs)
        self._last = self._sample(self._seqs, logits)

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> torch.Tensor:
        """Sample one token per row; record raw and sampling logprobs and top alternatives."""
        params = [s.req.params for s in seqs]
        tokens, lps, slps, tops = sample(logits, params, [s.gen for s in seqs], self._gen)
        for s, t, lp, slp, top in zip(seqs, tokens.tolist(), lps, slps, tops, strict=True):
            self._append(s, t, lp, slp, top)
        return tokens

    def _append(
        self, s: _Seq, token: int, lp: float, slp: float, top: list[tuple[int, float]]
    ) -> None:
        """Add a sampled token to a choice: detokenise, then check stop conditions."""
        s.ids.append(token)
        s.lps.append(lp)
        s.slps.append(slp)
        s.tops.append(top)
        req, params = s.req, s.req.params
        if token in req.stop_ids or (token in self.eos_token_ids and not params.ignore_eos):
            s.finish = "stop"
            s.stop_reason = token if token in req.stop_ids else None
            self._detokenize(s, len(s.ids) - 1, final=True)  # the stop token is not text
            return
        start = len(s.text)
        final = len(s.ids) >= req.max_tokens
        self._detokenize(s, len(s.ids), final=final)
        if req.stops and len(s.text) > start:
            hit = find_stop(s.text, start, req.stops)
            if hit:
                cut, stop = hit
                s.text = s.text[:cut]
                s.finish, s.stop_reason = "stop", stop
                return
        if final:
            s.finish = "length"

    def _detokenize(self, s: _Seq, end: int, *, final: bool) -> None:
        """Incremental decoding of ``ids[:end]`` over a short window. An incomplete UTF-8
        sequence at the end waits for the next token, unless ``final``."""
        skip = s.req.params.skip_special_tokens
        text = decode_increment(
            self.tokenizer, s.ids, s.prefix, s.read, end, skip_special_tokens=skip, final=final
        )
        if text:
            s.text += text
            s.prefix, s.read = s.read, end

    def _flush(self) -> None:
        """Send each request its choices' new deltas; drop finished and aborted rows."""
        by_req: dict[int, tuple[_Request, list[Choice]]] = {}
        keep: list[int] = []
        for row, s in enumerate(self._seqs):
            if s.req.aborted:
                continue
            if s.finish is None and s.flushed == len(s.ids):
                keep.append(row)
                continue
            if s.finish is None:
                keep.append(row)
                release = max(s.sent, len(s.text) - s.req.hold)
            else:
                release = len(s.text)
            delta = Choice(
                index=s.index,
                token_ids=s.ids[s.flushed :],
                logprobs=s.lps[s.flushed :],
                sampling_logprobs=s.slps[s.flushed :],
                top_logprobs=s.tops[s.flushed :],
                text=s.text[s.sent : release],
                finish_reason=s.finish,
                stop_reason=s.stop_reason,
                weights_version=self.weights_version,
            )
            s.flushed, s.sent = len(s.ids), release
            by_req.setdefault(id(s.req), (s.req, []))[1].append(delta)
        by_loop: dict[int, list[tuple[_Request, list[Choice]]]] = {}
        for req, deltas in by_req.values():
            by_loop.setdefault(id(req.loop), []).append((req, deltas))
        for items in by_loop.values():  # one wake-up per event loop, not one per request
            try:
                items[0][0].loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                for req, _ in items:
                    req.aborted = True
        self.stats["generated_tokens"] += sum(
            len(d.token_ids) for _, ds in by_req.values() for d in ds
        )
        if len(keep) == len(self._seqs):
            return
        if not keep:
            self._reset_batch()
            return
        assert self._cache is not None
        index = torch.tensor(keep, device=self.device)
        self._seqs = [self._seqs[i] for i in keep]
        self._pad, self._last = self._pad[index], self._last[index]
        trim = int(self._pad.min())
        for layer in self._cache.layers:
            layer.keys = layer.keys[index, :, trim:]
            layer.values = layer.values[index, :, trim:]
        self._pad -= trim
        self._len -= trim
        self._padded = bool(self._pad.any())

    def describe(self) -> dict[str, Any]:
        """Counters (steps, tokens prefilled, decoded and sent) and the current load."""
        with self._cv:
            waiting = len(self._waiting)
        return {
            **self.stats,
            "running": len(self._seqs),
            "waiting": waiting,
            "weights_version": self.weights_version,
            **({"adapter_versions": dict(self.adapter_versions)} if self.adapters else {}),
        }


def _deliver(items: list[tuple[_Request, list[Choice]]]) -> None:
    """On a request's event loop: queue each request's deltas."""
    for req, deltas in items:
        req.queue.put_nowait(deltas)


def _failure(e: Exception) -> EngineError:
    error = EngineError(f"generation failed: {type(e).__name__}: {e}")
    error.__cause__ = e
    return error


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad a ``[batch, heads, length, dim]`` tensor on the left to ``width`` columns."""
    return t if t.shape[-2] == width else F.pad(t, (0, 0, width - t.shape[-2], 0))
