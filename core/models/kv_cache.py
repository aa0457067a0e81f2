"""What a loaded model's KV cache allows: the keyword its forward takes a cache under
(:func:`cache_keyword`), whether one cache of a prompt prefix can serve several rows that go on
from it (:func:`shares_prefix_cache`), and feeding a prefix once for them (:func:`prefill`).

The engine's prefix cache (:mod:`voltrl.serving.engine.prefix_cache`) and the update's shared
prefix (:mod:`voltrl.algorithms.local.shared_prefix`) both stand on these.
"""

from __future__ import annotations

import functools
import inspect
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
"""The fewest shared prompt tokens worth feeding once, in the update's micro-batches
(:func:`~voltrl.algorithms.local.shared_prefix.split_common_prefix`) and the engine's prefix
cache alike."""
