"""The :class:`Engine`: continuous-batching generation for a causal LM on a thread of its own.

Requests enter from any event loop (:meth:`Engine.stream`, :meth:`Engine.generate`) and new
weights from any thread (:meth:`Engine.update_weights`); the engine thread admits waiting
requests at each step boundary, prefills them together, then decodes one token for every
running choice per forward pass (:mod:`.batch` holds the rows' KV cache, :mod:`.sequences`
each choice's tokens and text). The tokens every new prompt begins with are fed once, and kept
for later prompts that begin with them too (:mod:`.prefixes`).
"""

from __future__ import annotations

import collections
import secrets
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from voltrl.models.kv_cache import cache_keyword, shares_prefix_cache
from voltrl.models.lora import adapter_key, adapter_of
from voltrl.models.threads import decide_threads, use_threads
from voltrl.serving.engine.batch import Batch
from voltrl.serving.engine.front import EngineFront
from voltrl.serving.engine.prefix_cache import KV, PrefixCache, shared_length
from voltrl.serving.engine.sampling import (
    Choice,
    SamplingParams,
    sample,
)
from voltrl.serving.engine.sequences import (
    EngineError,
    Request,
    Seq,
    deliver,
    failure,
    wait_for_update,
)


class Engine(EngineFront):
    """Continuous-batching generation for a causal LM, on its own thread.

    Args:
        model: a Hugging Face causal LM whose cache layers are full-attention
            ``DynamicLayer``s (Llama, Qwen2, Mistral without sliding window, ...), or a
            ``peft`` model of one.
        tokenizer: its tokenizer (for detokenisation and stop strings).
        max_batch_size: most choices decoded together; more requests wait their turn.
        max_prefill_tokens: most padded prompt tokens prefilled in one step, not counting
            those the prefix cache already holds (at least one request is always admitted).
        max_model_len: context length (prompt + generated); defaults to the model's
            ``max_position_embeddings``.
        seed: seeds the sampling of requests that give no seed of their own.
        threads: torch intra-op threads of the engine thread (default: the count in effect
            in the thread that builds the engine, e.g. as LocalRL set it).
        lora_adapters: serve the ``peft`` model's LoRA adapters by name, unmerged (a request
            naming none gets the base model). Without it a peft model is served as it is,
            its active adapter applied to every request.
        prefix_cache_tokens: most prompt-prefix tokens whose keys and values are kept for
            later prompts that begin with them (:mod:`.prefixes`); 0 feeds every prompt
            whole. Models whose cache cannot serve a prefix (sliding windows) never keep any.
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
        prefix_cache_tokens: int = 8192,
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
        self._waiting: collections.deque[Request] = collections.deque()
        self._updates: list[
            tuple[Mapping[str, torch.Tensor], bool, str | None, threading.Event, list]
        ] = []
        self._thread: threading.Thread | None = None
        self._closing = False
        self._batch = Batch(self.device)
        self._prefixes = (
            PrefixCache(prefix_cache_tokens)
            if prefix_cache_tokens > 0 and shares_prefix_cache(model)
            else None
        )

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

    # ---- requests -------------------------------------------------------------------------
    def _submit(
        self, prompt: list[int], params: SamplingParams, rid: str | None, adapter: str | None
    ) -> Request:
        max_tokens = self.check(prompt, params, adapter)
        rid = rid or f"req-{uuid.uuid4().hex[:16]}"
        req = Request(rid, prompt, params, max_tokens, adapter)
        self.start()
        with self._cv:
            self._waiting.append(req)
            self._cv.notify_all()
        return req

    def _abort(self, req: Request) -> None:
        with self._cv:  # the engine thread drops the aborted rows at its next step
            self._cv.notify_all()

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
        wait_for_update(done, self._thread)
        if box and isinstance(box[0], BaseException):
            raise box[0]
        return self.weights_version

    def _load(self, state: Mapping[str, torch.Tensor], strict: bool, adapter: str | None) -> None:
        try:
            self._load_weights(state, strict, adapter)
        finally:  # the kept prefixes were computed with the old weights, even if this failed
            if self._prefixes is not None:  # part-way: load_state_dict copies key by key
                self._prefixes.clear()

    def _load_weights(
        self, state: Mapping[str, torch.Tensor], strict: bool, adapter: str | None
    ) -> None:
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
        new: list[Request] = []
        updates: list[Any] = []
        try:
            while True:
                with self._cv:
                    while not (self._closing or self._waiting or self._batch.seqs or self._updates):
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
                for group in self._by_prefix(new):
                    try:
                        with torch.inference_mode():
                            self._prefill(group)
                    except Exception as e:  # the running batch is untouched: fail the group
                        for req in group:
                            req.emit(failure(e))
                new = []
                if self._batch.seqs:
                    try:
                        with torch.inference_mode():
                            self._flush()  # first tokens out at once; drops rows already done
                            if self._batch.seqs:
                                self._decode()
                                self._flush()
                    except Exception as e:
                        for req in self._requests_of([]):
                            req.emit(failure(e))
                        self._batch.reset()
        finally:  # closed, or a bug: no request may wait forever
            reason = "was closed" if self._closing else "stopped unexpectedly"
            error = EngineError(f"the engine {reason}")
            with self._cv:
                self._closing = True
                pending = [*new, *self._waiting]
                self._waiting.clear()
                for *_, done, box in [*updates, *self._updates]:  # taken ones too: none waits
                    if not done.is_set():
                        box.append(error)
                        done.set()
            for req in self._requests_of(pending):
                req.emit(error)
            self._batch.reset()

    def _requests_of(self, extra: list[Request]) -> list[Request]:
        seen: dict[int, Request] = {id(r): r for r in extra}
        for s in self._batch.seqs:
            seen.setdefault(id(s.req), s.req)
        return list(seen.values())

    def _admit(self) -> list[Request]:
        """Take waiting requests that fit the batch (called holding the lock)."""
        rows, new, longest = len(self._batch.seqs), [], 0
        while self._waiting:
            req = self._waiting[0]
            if req.aborted:
                self._waiting.popleft()
                continue
            kept = self._prefixes.cached_length(req.adapter, req.prompt) if self._prefixes else 0
            longest = max(longest, len(req.prompt) - kept)
            over = longest * (len(new) + 1) > self.max_prefill_tokens
            if rows + req.params.n > self.max_batch_size or (new and over):
                break
            self._waiting.popleft()
            new.append(req)
            rows += req.params.n
        return new

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor | None,
        pos: torch.Tensor,
        cache: DynamicCache,
        reqs: Sequence[Request],
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

    def _prefill(self, new: list[Request]) -> None:
        """Run the new prompts together, sample each choice's first token, join the batch.

        The tokens every new prompt begins with are fed once (or taken from the prefix
        cache): the rows then go on from their keys and values, the cache laid out as
        ``[prefix][row i's padding][row i's rest]``, then rearranged to the batch's
        left-padded ``[padding][prefix][rest]``."""
        start, kv = self._shared_prefix(new)
        lengths = [len(r.prompt) - start for r in new]
        width = max(lengths)
        ids = torch.full((len(new), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(new), start + width), dtype=torch.long)
        mask[:, :start] = 1
        for i, r in enumerate(new):
            ids[i, width - lengths[i] :] = torch.tensor(r.prompt[start:])
            mask[i, start + width - lengths[i] :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, start:]
        cache = DynamicCache()
        for layer, (k, v) in enumerate(kv):
            cache.update(k.expand(len(new), -1, -1, -1), v.expand(len(new), -1, -1, -1), layer)
        logits = self._forward(ids, mask, pos, cache, new)
        self.stats["prefill_tokens"] += sum(lengths)
        pad = torch.tensor([width - n for n in lengths], device=self.device)
        if start:
            _prefix_after_padding(cache, pad, start)
        rows = [i for i, r in enumerate(new) for _ in range(r.params.n)]
        if rows != list(range(len(new))):
            index = torch.tensor(rows, device=self.device)
            for layer in cache.layers:
                layer.batch_select_indices(index)
            logits = logits[index]
            pad = pad[index]
        seqs = [Seq(r, j, self._seq_generator(r, j)) for r in new for j in range(r.params.n)]
        tokens = self._sample(seqs, logits)
        self._batch.join(seqs, cache, pad, start + width, tokens)

    def _by_prefix(self, new: list[Request]) -> list[list[Request]]:
        """The new requests in groups prefilled together: by adapter and first tokens (an
        agent role's system prompt), so that each group shares a prefix even when the roles
        of a multi-agent step arrive together; one group when no prefixes are kept."""
        if self._prefixes is None:
            return [new]
        groups: dict[tuple[str | None, tuple[int, ...]], list[Request]] = {}
        head = self._prefixes.min_tokens
        for r in new:
            groups.setdefault((r.adapter, tuple(r.prompt[:head])), []).append(r)
        return list(groups.values())

    def _shared_prefix(self, new: list[Request]) -> tuple[int, KV]:
        """How many leading tokens every new prompt shares and their keys and values: what
        the prefix cache holds of them, the rest fed now (one row) and kept there. ``(0, [])``
        when they share fewer than the cache's ``min_tokens``, name different adapters, or
        the engine keeps no prefixes."""
        cached = self._prefixes
        adapter = new[0].adapter
        if cached is None or any(r.adapter != adapter for r in new):
            return 0, []
        prompts = [r.prompt for r in new]
        length = shared_length(prompts)
        if length < cached.min_tokens:
            return 0, []
        epoch = cached.epoch
        start, kv = cached.longest(adapter, prompts)
        self.stats["prefix_cached_tokens"] += start * len(new)
        if start < length:
            cache = DynamicCache()
            for layer, (k, v) in enumerate(kv):
                cache.update(k, v, layer)
            ids = torch.tensor([prompts[0][start:length]], device=self.device)
            pos = torch.arange(start, length, device=self.device)[None]
            self._forward(ids, None, pos, cache, new[:1])
            self.stats["prefill_tokens"] += length - start
            kv = [(layer.keys, layer.values) for layer in cache.layers]
            cached.add(adapter, prompts[0][:length], kv, epoch)
        return length, kv

    def _seq_generator(self, req: Request, index: int) -> torch.Generator | None:
        if req.params.seed is None or req.params.temperature == 0:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed((req.params.seed * 1_000_003 + index) % (2**63))
        return gen

    def _decode(self) -> None:
        """One forward pass for every running choice: feed its last token, sample the next."""
        batch = self._batch
        assert batch.cache is not None
        ids, mask, pos = batch.decode_inputs()
        logits = self._forward(ids, mask, pos, batch.cache, [s.req for s in batch.seqs])
        self.stats["steps"] += 1
        self.stats["decode_tokens"] += len(batch.seqs)
        batch.advance(self._sample(batch.seqs, logits))

    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> torch.Tensor:
        """Sample one token per row; record raw and sampling logprobs and top alternatives."""
        params = [s.req.params for s in seqs]
        tokens, lps, slps, tops = sample(logits, params, [s.gen for s in seqs], self._gen)
        for s, t, lp, slp, top in zip(seqs, tokens.tolist(), lps, slps, tops, strict=True):
            s.append(t, lp, slp, top, eos_token_ids=self.eos_token_ids, tokenizer=self.tokenizer)
        return tokens

    def _flush(self) -> None:
        """Send each request its choices' new deltas; drop finished and aborted rows."""
        by_req: dict[int, tuple[Request, list[Choice]]] = {}
        keep: list[int] = []
        for row, s in enumerate(self._batch.seqs):
            if s.req.aborted:
                continue
            if s.finish is None:
                keep.append(row)
            delta = s.take_delta()
            if delta is not None:
                by_req.setdefault(id(s.req), (s.req, []))[1].append(delta)
        by_loop: dict[int, list[tuple[Request, list[Choice]]]] = {}
        for req, deltas in by_req.values():
            by_loop.setdefault(id(req.loop), []).append((req, deltas))
        for items in by_loop.values():  # one wake-up per event loop, not one per request
            try:
                items[0][0].loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                for req, _ in items:
                    req.aborted = True
        self.stats["generated_tokens"] += sum(
            len(d.token_ids) for _, ds in by_req.values() for d in ds
        )
        self._batch.keep(keep)

    def describe(self) -> dict[str, Any]:
        """Counters (steps, tokens prefilled, decoded and sent) and the current load."""
        with self._cv:
            waiting = len(self._waiting)
        return {
            **self.stats,
            "running": len(self._batch.seqs),
            "waiting": waiting,
            "weights_version": self.weights_version,
            **({"adapter_versions": dict(self.adapter_versions)} if self.adapters else {}),
        }


def _prefix_after_padding(cache: DynamicCache, pad: torch.Tensor, start: int) -> None:
    """Rearrange each row's cache columns from ``[prefix][padding][rest]`` (``start`` prefix
    columns, ``pad[i]`` padding columns) to the left-padded ``[padding][prefix][rest]``: a
    permutation of each row's columns, the padding moved before the prefix."""
    layer = cache.layers[0]
    columns = torch.arange(layer.keys.shape[-2], device=pad.device)[None]
    p = pad[:, None]
    source = torch.where(
        columns < p, columns + start, torch.where(columns < p + start, columns - p, columns)
    )
    for layer in cache.layers:
        index = source[:, None, :, None].expand_as(layer.keys)
        layer.keys = layer.keys.gather(2, index)
        layer.values = layer.values.gather(2, index)
