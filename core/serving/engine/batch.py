"""The engine's running batch: one row per choice, their shared KV cache and left padding.

Prefilled rows join the batch with their own cache, the shorter of the two left-padded to the
longer; each decode step feeds every row its last sampled token at its own position; rows
that finish leave at once, and the cache columns that are padding in every remaining row are
trimmed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from voltrl.serving.engine.sequences import EngineError, Seq


class Batch:
    """The rows being decoded: ``seqs`` (a choice each), their KV ``cache``, each row's left
    padding ``pad``, the cache ``length``, and each row's ``last`` sampled token (not yet in
    the cache). Touched only by the engine thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seqs: list[Seq] = []
        self.cache: DynamicCache | None = None
        self.pad = torch.zeros(0, dtype=torch.long, device=device)
        self.length = 0
        self.padded = False  # whether any row has left padding (else no mask is needed)
        self.last = torch.zeros(0, dtype=torch.long, device=device)

    def reset(self) -> None:
        """Drop every row."""
        self.seqs, self.cache, self.length, self.padded = [], None, 0, False
        self.pad = self.pad[:0]
        self.last = self.last[:0]

    def join(
        self,
        seqs: list[Seq],
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
        if self.cache is None:
            self.seqs, self.cache, self.pad, self.length = seqs, cache, pad, length
            self.last = tokens
            self.padded = bool(pad.any())
            return
        width = max(self.length, length)
        for old, add in zip(self.cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(add.keys, width)])
            old.values = torch.cat([_left_pad(old.values, width), _left_pad(add.values, width)])
        self.pad = torch.cat([self.pad + width - self.length, pad + width - length])
        self.length = width
        self.padded = bool(self.pad.any())
        self.seqs += seqs
        self.last = torch.cat([self.last, tokens])

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The next decode step's ``(input ids, attention mask or None, position ids)``: each
        row's last token at its own position."""
        mask = None
        if self.padded:
            cols = torch.arange(self.length + 1, device=self.device)
            mask = (cols[None, :] >= self.pad[:, None]).long()
        pos = (self.length - self.pad)[:, None]
        return self.last[:, None], mask, pos

    def advance(self, tokens: torch.Tensor) -> None:
        """After a decode step: the last tokens are in the cache, ``tokens`` are the rows'
        new last tokens."""
        self.length += 1
        self.last = tokens

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in order) and trim the cache columns that are left padding in
        every one of them."""
        if len(rows) == len(self.seqs):
            return
        if not rows:
            self.reset()
            return
        assert self.cache is not None
        index = torch.tensor(rows, device=self.device)
        self.seqs = [self.seqs[i] for i in rows]
        self.pad, self.last = self.pad[index], self.last[index]
        trim = int(self.pad.min())
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, trim:]
            layer.values = layer.values[index, :, trim:]
        self.pad -= trim
        self.length -= trim
        self.padded = bool(self.pad.any())


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad a ``[batch, heads, length, dim]`` tensor on the left to ``width`` columns."""
    return t if t.shape[-2] == width else F.pad(t, (0, 0, width - t.shape[-2], 0))
