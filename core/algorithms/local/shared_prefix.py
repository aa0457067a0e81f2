"""A prompt prefix fed once for many rows: its KV cache, repeated, serves every row it begins.

The rows of a micro-batch usually begin with the same tokens (an agent's system prompt and tool
schemas). :func:`split_common_prefix` takes them out of the rows;
:func:`~voltrl.models.kv_cache.prefill` feeds them once and repeats their keys and values for
every row, which :func:`~voltrl.algorithms.local.loss.token_logprobs` then attends to: the same
logprobs and gradients as feeding the prefix in each row, for the cost of one row.
:func:`~voltrl.models.kv_cache.shares_prefix_cache` says where this is exact (full attention, a
forward that takes a cache, no gradient checkpointing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from voltrl.models.kv_cache import MIN_SHARED_PREFIX, shares_prefix_cache


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
