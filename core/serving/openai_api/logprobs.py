"""Logprobs as OpenAI shapes them: each token's display string and UTF-8 bytes.

Byte-level BPE vocabularies (GPT-2's, Qwen's) hold a token as printable stand-ins for bytes;
:class:`TokenText` maps them back, so that ``bytes`` are the token's real bytes and a token
that is part of a multi-byte character shows as the replacement character, as OpenAI does.
"""

from __future__ import annotations

from typing import Any


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-printable-character table that byte-level BPE vocabularies use."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return table


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


class TokenText:
    """Per-token display strings and UTF-8 bytes for logprobs, cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        self.added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        """The token's display string and its UTF-8 bytes."""
        hit = self.cache.get(token_id)
        if hit is None:
            if token_id in self.added:
                raw = self.added[token_id].encode()
            else:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if self.byte_level and all(ch in _BYTE_DECODER for ch in piece):
                    raw = bytes(_BYTE_DECODER[ch] for ch in piece)
                else:
                    raw = self.tokenizer.decode([token_id]).encode()
            hit = self.cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit


def chat_logprobs(
    tokens: TokenText,
    ids: list[int],
    values: list[float],
    tops: list[list[tuple[int, float]]],
) -> dict[str, Any]:
    """``logprobs`` of a chat choice (or delta), as OpenAI shapes them."""
    content = []
    for tid, lp, top in zip(ids, values, tops, strict=True):
        text, raw = tokens(tid)
        alts = []
        for alt, alp in top:
            atext, araw = tokens(alt)
            alts.append({"token": atext, "logprob": alp, "bytes": araw})
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alts})
    return {"content": content}


def completion_logprobs(
    tokens: TokenText,
    ids: list[int],
    values: list[float],
    tops: list[list[tuple[int, float]]],
    offset: int,
) -> dict[str, Any]:
    """``logprobs`` of a completion choice (or delta) whose text starts at ``offset``, as
    OpenAI shapes them."""
    texts, offsets = [], []
    for tid in ids:
        text = tokens(tid)[0]
        texts.append(text)
        offsets.append(offset)
        offset += len(text)
    top_dicts = [{tokens(a)[0]: lp for a, lp in top} if top else None for top in tops]
    return {
        "tokens": texts,
        "token_logprobs": values,
        "top_logprobs": top_dicts,
        "text_offset": offsets,
    }
