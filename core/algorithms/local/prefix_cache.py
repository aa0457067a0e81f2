"""A prompt prefix fed once for many rows: its KV cache, repeated, serves every row it begins.

The rows of a micro-batch usually begin with the same tokens (an agent's system prompt and tool
schemas). :func:`split_common_prefix` takes them out of the rows; :func:`prefill` feeds them once
and repeats their keys and values for every row, which
:func:`~voltrl.algorithms.local.loss.token_logprobs` then attends to: the same logprobs and
gradients as feeding the prefix in each row, for the cost of one row. :func:`shares_prefix_cache`
says where this is exact (full attention, a forward that takes a cache, no gradient
checkpointing); :func:`cache_keyword` is also how the engine passes its cache.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def cache_keyword(model: Any) -> str | None:
    """The keyword under which ``model``'s forward takes a KV cache: ``cache`` in recent
    transformers, ``past_key_values`` before (a ``peft`` wrapper is looked through); ``None``
    when it names neither."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _cache_keyword_of(type(base))


@functools.cache
def _cache_keyword_of(cls: type) -> str | None:
    """:func:`cache_keyword` for a model class (read once: it is asked per micro-batch)."""
    params = inspect.signature(cls.forward).parameters
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def checkpointing(model: Any) -> bool:
    """Whether ``model`` recomputes activations in this forward's backward pass: some module
    has gradient checkpointing on (under either of transformers' names for it), the model is
    training and autograd is recording."""
    return (
        model.training
        and torch.is_grad_enabled()
        and any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    )


def shares_prefix_cache(model: Any) -> bool:
    """Whether one KV cache of a prefix can serve rows that go on from it at their own
    positions (:func:`split_common_prefix`): every layer attends to all earlier tokens (a
    sliding window or a recurrent layer would count the masked columns between the prefix
    and a row), the forward takes a cache, and no checkpointed layer would add its keys to it
    again. Where it cannot, rows are fed whole."""
    config = model.config
    layers = getattr(config, "layer_types", None) or ["full_attention"]
    return (
        all(kind == "full_attention" for kind in layers)
        and not getattr(config, "sliding_window", None)
        and cache_keyword(model) is not None
        and not checkpointing(model)
    )


def prefill(model: Any, prefix: Tensor, *, repeat: int) -> dict[str, Any]:
    """Feed ``prefix`` (``(L,)``) at positions ``0..L-1`` and return its KV cache, repeated
    for ``repeat`` rows, as the keyword argument ``model``'s forward takes it. The cache keeps
    its autograd graph: a loss on the rows that attend to it reaches the prefix's weights."""
    from transformers import DynamicCache

    cache = DynamicCache()
    positions = torch.arange(len(prefix), device=prefix.device)[None]
    keyword = cache_keyword(model)
    if keyword is None:
        raise ValueError(f"{type(model).__name__}.forward takes no KV cache")
    model(
        input_ids=prefix[None],
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{keyword: cache},
    )
    cache.batch_repeat_interleave(repeat)
    return {keyword: cache}


MIN_SHARED_PREFIX = 16
"""The fewest shared prompt tokens worth feeding once (:func:`split_common_prefix`)."""


def split_common_prefix(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    prompt_lengths: Sequence[int],
    *,
    min_length: int = MIN_SHARED_PREFIX,
) -> tuple[Tensor | None, Tensor, Tensor, Tensor]:
    """Take the prompt tokens that every row starts with out of the rows, to be fed once.

    The rows are ``prompt + response`` (``(B, P + R)``), prompts left-padded to
    ``P = max(prompt_lengths)``. With ``L`` the length of the longest run of tokens every
    prompt starts with (an agent's system prompt and tool schemas), at most one less than the
    shortest prompt (each row keeps the token that predicts its first response token)::

        prefix          = the first L tokens of row 0's prompt          (L,)
        row i, column j = the row without its first L columns           (B, P - L + R)
        mask[i, j]      = 0 where j < P - p_i        (row i's padding and copy of the prefix)

    The positions are the rows' own (the remaining tokens keep theirs, ``>= L``), so
    ``token_logprobs(model, ..., prefix=prefix)`` gives each row's logprobs as without the
    split. Returns ``(prefix, input_ids, attention_mask, position_ids)``, with ``prefix`` ``None``
    and the inputs unchanged when fewer than ``min_length`` tokens are shared or ``model``
    cannot share a prefix's KV cache (:func:`shares_prefix_cache`).
    """
    longest = max(prompt_lengths)
    most = min(prompt_lengths) - 1
    unchanged = (None, input_ids, attention_mask, position_ids)
    if most < min_length or len(prompt_lengths) < 2 or not shares_prefix_cache(model):
        return unchanged
    starts = longest - torch.tensor(prompt_lengths, device=input_ids.device)
    heads = input_ids.gather(1, starts[:, None] + torch.arange(most, device=input_ids.device))
    same = (heads == heads[:1]).all(0)
    length = most if bool(same.all()) else int(same.int().argmin())
    if length < min_length:
        return unchanged
    mask = attention_mask[:, length:].clone()
    columns = torch.arange(longest - length, device=mask.device)
    mask[:, : longest - length] *= (columns[None] >= starts[:, None]).to(mask.dtype)
    return heads[0, :length], input_ids[:, length:], mask, position_ids[:, length:]
