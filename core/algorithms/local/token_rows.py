"""A training batch's rows on the model's device, fed to the model micro-batch by micro-batch.

The policy update and SFT both score rows this way: :meth:`TokenRows.micro_batches` groups
rows that feed few tokens together
(:func:`~voltrl.algorithms.local.micro_batches.plan_micro_batches`), and
:meth:`TokenRows.logprobs` feeds one group from the column its longest prompt starts at to its
last trained token, the prompt tokens all its rows start with once
(:func:`~voltrl.algorithms.local.shared_prefix.split_common_prefix`), and returns the logprobs
of the trained tokens (:func:`~voltrl.algorithms.local.loss.token_logprobs`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from voltrl.algorithms.local import micro_batches
from voltrl.algorithms.local.loss import token_logprobs
from voltrl.algorithms.local.shared_prefix import split_common_prefix
from voltrl.models.kv_cache import shares_prefix_cache
from voltrl.trajectory import TrainingBatch


@dataclass
class TokenRows:
    """A :class:`~voltrl.trajectory.TrainingBatch` as tensors on one device, with what cutting
    it into micro-batches needs (``B`` rows, prompts left-padded to ``P``, responses ``R``)."""

    tensors: dict[str, Tensor]  # every field of ``TrainingBatch.to_torch``
    input_ids: Tensor  # (B, P + R)
    attention_mask: Tensor  # (B, P + R)
    position_ids: Tensor  # (B, P + R)
    response_mask: Tensor  # (B, R), the loss mask
    prompt_lengths: list[int]  # real prompt tokens per row
    prompts: list[list[int]]  # each row's real prompt tokens
    response_ends: list[int]  # 1 + index of the last trained token (0: none)
    prompt_width: int  # P

    @classmethod
    def of(cls, batch: TrainingBatch, device: Any) -> TokenRows:
        """``batch`` on ``device``. Raises ``ValueError`` when a row with trained tokens has
        an empty prompt (its first token would have no context)."""
        t = batch.to_torch(device)
        mask = t["response_mask"]
        r = mask.shape[1]
        last = r - torch.flip(mask, dims=[1]).argmax(dim=1)
        ends = torch.where(mask.sum(1) > 0, last, torch.zeros_like(last))
        lengths = t["prompt_mask"].sum(1).tolist()
        p = batch.prompt_length
        rows = cls(
            tensors=t,
            input_ids=t["input_ids"],
            attention_mask=t["attention_mask"],
            position_ids=t["position_ids"],
            response_mask=mask,
            prompt_lengths=lengths,
            prompts=[ids[p - n :] for ids, n in zip(batch.prompt_ids, lengths, strict=True)],
            response_ends=ends.tolist(),
            prompt_width=p,
        )
        empty = [i for i in rows.trained if rows.prompt_lengths[i] == 0]
        if empty:
            raise ValueError(f"rows {empty} have an empty prompt: their first token has no context")
        return rows

    @property
    def trained(self) -> list[int]:
        """The rows with at least one trained token."""
        return [i for i, end in enumerate(self.response_ends) if end > 0]

    def micro_batches(
        self, model: Any, rows: list[int], *, max_rows: int, max_tokens: int | None = None
    ) -> Iterator[tuple[Tensor, int, int]]:
        """Split ``rows`` into micro-batches that feed ``model`` few tokens (at most
        ``max_rows`` rows and ``max_tokens`` padded tokens each). Yields ``(row index tensor,
        first column, response width)``: the columns ``[first, P + width)`` cover every real
        prompt token and every trained token of those rows."""
        # looked up when called: benchmarks/micro_batches_bench.py swaps in other planners
        plan = micro_batches.plan_micro_batches(
            [self.prompts[i] for i in rows],
            [self.response_ends[i] for i in rows],
            max_rows=max_rows,
            max_tokens=max_tokens,
            share_prefix=shares_prefix_cache(model),
        )
        for group in plan:
            part = [rows[k] for k in group]
            p = max(self.prompt_lengths[i] for i in part)
            w = max(self.response_ends[i] for i in part)
            yield torch.tensor(part, device=self.input_ids.device), self.prompt_width - p, w

    def logprobs(
        self, model: Any, idx: Tensor, first: int, width: int, **kw: Any
    ) -> tuple[Tensor, Tensor | None, tuple[float, float]]:
        """Logprobs (and entropies, as ``token_logprobs``'s ``kw`` ask) of the trained tokens
        of rows ``idx``, fed from column ``first`` to the end of their trained responses, the
        prompt tokens they all start with fed once; and how many tokens were fed, and how
        many of them were padding."""
        end = self.prompt_width + width
        prefix, ids, mask, positions = split_common_prefix(
            model,
            self.input_ids[idx, first:end],
            self.attention_mask[idx, first:end],
            self.position_ids[idx, first:end],
            [self.prompt_lengths[i] for i in idx.tolist()],
        )
        logprobs, entropy = token_logprobs(
            model,
            ids,
            mask,
            positions,
            width,
            keep=self.response_mask[idx, :width],
            prefix=prefix,
            **kw,
        )
        fed = mask[:, :-1]
        shared = 0 if prefix is None else len(prefix)
        return logprobs, entropy, (float(fed.numel() + shared), float(fed.numel() - fed.sum()))
