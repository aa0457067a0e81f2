"""Sampling for the LocalRL :class:`~.Engine`: a request's parameters and results, and the
per-step token sampling and incremental detokenisation the engine runs on its thread.

Logprob semantics (what the trainer's PPO ratio needs): ``logprobs`` are the log-probabilities
of each sampled token under the model's **raw** distribution, i.e. ``log_softmax(logits)`` at
temperature 1 before top-k/top-p, as vLLM returns by default (``raw_logprobs``).
``sampling_logprobs`` are the log-probabilities under the distribution actually sampled from
(after temperature, top-k and top-p; 0.0 for greedy), as vLLM's ``processed_logprobs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerBase

FinishReason = Literal["stop", "length"]
MAX_TOP_LOGPROBS = 20
"""The most alternatives a request may ask for per sampled token."""


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request. ``temperature=0`` is greedy; ``top_k`` 0 or -1 is off;
    ``max_tokens=None`` means up to the model's context length."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad parameter."""
        mt, t, p, k, n = self.max_tokens, self.temperature, self.top_p, self.top_k, self.n
        _require(mt is None or (is_int(mt) and mt >= 1), f"max_tokens must be >= 1, not {mt!r}")
        _require(_is_num(t) and 0 <= t <= 100, f"temperature must be in [0, 100], not {t!r}")
        _require(_is_num(p) and 0 < p <= 1, f"top_p must be in (0, 1], not {p!r}")
        _require(is_int(k) and k >= -1, f"top_k must be an integer >= -1 (0, -1: off), not {k!r}")
        _require(is_int(n) and n >= 1, f"n must be a positive integer, not {n!r}")
        _require(self.seed is None or is_int(self.seed), f"seed must be an integer: {self.seed!r}")
        stops_ok = all(isinstance(s, str) and s for s in self.stop)
        _require(stops_ok, "stop must be a non-empty string or a list of them")
        ids_ok = all(is_int(i) and i >= 0 for i in self.stop_token_ids)
        _require(ids_ok, "stop_token_ids must be a list of token ids")
        top = self.top_logprobs
        top_ok = is_int(top) and 0 <= top <= MAX_TOP_LOGPROBS
        _require(top_ok, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], not {top!r}")


@dataclass(slots=True)
class Choice:
    """Tokens, logprobs and text of one choice: what a step added (a delta, from
    :meth:`.Engine.stream`), or all of it once finished (from :meth:`.Engine.generate`).

    ``text`` of a delta is the newly released text: text that may still turn out to start a
    stop string is held back until it cannot. ``top_logprobs`` holds ``(token_id, raw
    logprob)`` pairs.
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    def add(self, delta: Choice) -> None:
        """Append a delta of this choice."""
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.sampling_logprobs += delta.sampling_logprobs
        self.top_logprobs += delta.top_logprobs
        self.text += delta.text
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason


@dataclass(slots=True)
class RequestOutput:
    """A finished request: the prompt's token ids and its ``n`` choices, in index order."""

    request_id: str
    prompt_token_ids: list[int]
    choices: list[Choice]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    gens: Sequence[torch.Generator | None],
    generator: torch.Generator,
) -> tuple[torch.Tensor, list[float], list[float], list[list[tuple[int, float]]]]:
    """Sample one token per row of ``logits``, each row under its own ``params``.

    Rows with a generator of their own (``gens``) draw from it, the rest from ``generator``.
    Returns the tokens, their raw and sampling logprobs, and each row's ``top_logprobs``
    alternatives as ``(token_id, raw logprob)`` pairs.
    """
    raw = torch.log_softmax(logits, dim=-1)
    temps = [p.temperature for p in params]
    if all(t == 0 for t in temps):
        tokens = raw.argmax(dim=-1)
        sampled = torch.zeros(len(params), device=logits.device)
    else:
        processed = processed_logprobs(params, logits, temps, raw)
        probs = processed.exp()
        tokens = raw.argmax(dim=-1)
        # Rows with a seed of their own draw from their generator, the rest in one call.
        shared = [i for i, g in enumerate(gens) if temps[i] > 0 and g is None]
        if shared:
            rows = torch.tensor(shared, device=logits.device)
            draws = torch.multinomial(probs[rows], 1, generator=generator).squeeze(1)
            tokens[rows] = draws
        for i, g in enumerate(gens):
            if temps[i] > 0 and g is not None:
                tokens[i] = torch.multinomial(probs[i], 1, generator=g)[0]
        sampled = processed.gather(1, tokens[:, None]).squeeze(1)
        sampled = torch.where(torch.tensor(temps, device=logits.device) == 0, 0.0, sampled)
    lps = raw.gather(1, tokens[:, None]).squeeze(1).tolist()
    k = max(p.top_logprobs for p in params)
    tops: list[list[tuple[int, float]]] = [[] for _ in params]
    if k:
        values, indices = raw.topk(k, dim=-1)
        for i, p in enumerate(params):
            kk = p.top_logprobs
            tops[i] = list(zip(indices[i, :kk].tolist(), values[i, :kk].tolist(), strict=True))
    return tokens, lps, sampled.tolist(), tops


def processed_logprobs(
    params: Sequence[SamplingParams], logits: torch.Tensor, temps: list[float], raw: torch.Tensor
) -> torch.Tensor:
    """Log-probabilities of the sampling distribution: temperature, then top-k, top-p
    (``raw``, the log-softmax of ``logits``, when none of them changes anything)."""
    device = logits.device
    top_ks = [p.top_k for p in params]
    top_ps = [p.top_p for p in params]
    unfiltered = all(k <= 0 for k in top_ks) and all(p >= 1 for p in top_ps)
    if unfiltered and all(t in (0, 1) for t in temps):
        return raw
    scaled = logits / torch.tensor([t if t > 0 else 1.0 for t in temps], device=device)[:, None]
    if unfiltered:
        return torch.log_softmax(scaled, dim=-1)
    vocab = logits.shape[-1]
    ordered, order = scaled.sort(dim=-1, descending=True)
    ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=device)
    ranks = torch.arange(vocab, device=device)
    ordered = ordered.masked_fill(ranks[None, :] >= ks[:, None], float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
    ps = torch.tensor(top_ps, device=device)
    ordered = ordered.masked_fill(before > ps[:, None], float("-inf"))
    kept = torch.full_like(scaled, float("-inf")).scatter(1, order, ordered)
    return torch.log_softmax(kept, dim=-1)


def decode_increment(
    tokenizer: PreTrainedTokenizerBase,
    ids: list[int],
    prefix: int,
    read: int,
    end: int,
    *,
    skip_special_tokens: bool,
    final: bool,
) -> str:
    """Incremental decoding of ``ids[:end]`` over a short window: the text ``ids[prefix:end]``
    adds to ``ids[prefix:read]``, or ``""`` to wait. An incomplete UTF-8 sequence at the end
    waits for the next token, unless ``final``."""
    skip = skip_special_tokens
    before = tokenizer.decode(ids[prefix:read], skip_special_tokens=skip)
    after = tokenizer.decode(ids[prefix:end], skip_special_tokens=skip)
    if len(after) > len(before) and (final or not after.endswith("\ufffd")):
        return after[len(before) :]
    return ""


def find_stop(text: str, start: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends past ``start`` (text before ``start`` was
    searched already), as ``(position, stop)``; ``None`` if there is none."""
    hits = [
        (i, stop) for stop in stops if (i := text.find(stop, max(0, start - len(stop) + 1))) >= 0
    ]
    return min(hits) if hits else None


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def is_int(x: Any) -> bool:
    """Whether ``x`` is an integer (a ``bool`` is not)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
