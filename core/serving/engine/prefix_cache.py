"""Prompt prefixes the engine has fed, kept with their KV cache for later prompts that begin so.

An agent sends its system prompt and tool schemas with every call, and a group of rollouts
sends the same task: most of a prompt is usually tokens the engine fed a moment ago. The
engine prefills the tokens that all of a step's new prompts share once, keeps their keys and
values here, and starts every later prompt that begins with them from where they end: on a
CPU, where prefill dominates an agent's rollouts, this is most of a step's time (see
``benchmarks/engine_bench.py --shared-prefix``).

The keys and values of a prompt's first ``k`` tokens do not depend on what follows them (causal
attention, rotary positions ``0..k-1``), so an entry serves any prompt it shares ``k`` tokens
with, cut to those ``k``. Entries are per LoRA adapter (each computes its own keys) and are
dropped whenever the engine's weights change (:meth:`PrefixCache.clear`, which also refuses
an entry computed before it and added after). The oldest are evicted beyond ``max_tokens``
cached tokens in all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from voltrl.models.kv_cache import MIN_SHARED_PREFIX

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Each layer's ``(keys, values)`` of one row: ``(1, kv heads, tokens, head dim)``."""


@dataclass(eq=False)  # entries are told apart by identity, never by comparing tensors
class Prefix:
    """A fed prefix: its tokens, the adapter that computed it and its keys and values."""

    adapter: str | None
    tokens: tuple[int, ...]
    kv: KV


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def shared_length(prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every prompt shares, at most one less than the shortest (each
    prompt keeps a token of its own to predict its first generated token from)."""
    n = min(map(len, prompts)) - 1
    for p in prompts[1:]:
        n = min(n, common_length(prompts[0], p))
    return n


class PrefixCache:
    """Prefixes by adapter, most recently used last; ``max_tokens`` cached tokens at most."""

    def __init__(self, max_tokens: int = 8192, min_tokens: int = MIN_SHARED_PREFIX) -> None:
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.epoch = 0
        """How many times the cache was cleared: :meth:`add` takes the epoch its keys and
        values were computed in, and drops them when a clear came in between."""
        self._entries: list[Prefix] = []

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Tokens cached in all."""
        return sum(len(e.tokens) for e in self._entries)

    def clear(self) -> None:
        """Forget every prefix (the weights they were computed with are gone)."""
        self._entries = []
        self.epoch += 1

    def longest(self, adapter: str | None, prompts: Sequence[Sequence[int]]) -> tuple[int, KV]:
        """The most leading tokens of every prompt that one entry holds (``0`` and ``[]``
        below ``min_tokens``), and that entry's keys and values cut to them."""
        best, found = 0, None
        cap = min(map(len, prompts)) - 1
        for entry in self._entries:
            if entry.adapter != adapter:
                continue
            n = min(cap, len(entry.tokens))
            for p in prompts:
                n = common_length(entry.tokens[:n], p[:n])
                if n <= best:
                    break
            if n > best:
                best, found = n, entry
        if found is None or best < self.min_tokens:
            return 0, []
        self._entries = [*(e for e in self._entries if e is not found), found]
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in found.kv]

    def cached_length(self, adapter: str | None, prompt: Sequence[int]) -> int:
        """How many leading tokens of ``prompt`` one entry holds (``0`` below
        ``min_tokens``): what feeding it would not cost. Leaves the entries' order alone."""
        best = 0
        for entry in self._entries:
            if entry.adapter == adapter:
                n = min(len(prompt) - 1, len(entry.tokens))
                best = max(best, common_length(entry.tokens[:n], prompt[:n]))
        return best if best >= self.min_tokens else 0

    def add(self, adapter: str | None, tokens: Sequence[int], kv: KV, epoch: int) -> None:
        """Keep ``tokens``' keys and values, computed in ``epoch`` (dropped if the cache was
        cleared since); entries it begins with are dropped (it serves whatever they served),
        then the oldest while more than ``max_tokens`` are cached."""
        if epoch != self.epoch or not self.min_tokens <= len(tokens) <= self.max_tokens:
            return
        tokens = tuple(tokens)
        self._entries = [
            e
            for e in self._entries
            if not (e.adapter == adapter and tokens[: len(e.tokens)] == e.tokens)
        ]
        self._entries.append(Prefix(adapter, tokens, kv))
        while self.tokens > self.max_tokens:
            self._entries.pop(0)
