"""Tiny tokenizer and model built without a hub: for tests, benchmarks and the offline demo.

The tokenizer is a committed fixture (``assets/tiny-tokenizer``, made by
``scripts/make_tiny_tokenizer.py``): a 434-token byte-level BPE with ChatML special tokens,
Hermes tool-call tokens and a Qwen2.5-style chat template that renders ``tools``. The model is a
randomly initialised ``Qwen2ForCausalLM`` sized for it, deterministic for a given seed.

The name :data:`TINY` picks these (:func:`voltrl.models.loading.load_model`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

TINY_TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "tiny-tokenizer"
"""Where the committed tiny tokenizer fixture lives (``from_pretrained`` loads it)."""


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny ChatML tokenizer: ``<|im_end|>`` is EOS, ``<|endoftext|>`` is padding."""
    return PreTrainedTokenizerFast.from_pretrained(str(TINY_TOKENIZER_DIR))


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 4096,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Qwen2ForCausalLM:
    """A randomly initialised ``Qwen2ForCausalLM`` for ``tokenizer``, in eval mode.

    The same arguments give the same weights; the global torch RNG is left untouched.
    ``<|im_end|>`` and ``<|endoftext|>`` (when the tokenizer has them) end generation.
    """
    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"heads ({heads}) must divide hidden ({hidden}) and kv_heads ({kv_heads}) heads"
        )
    eos = [
        i
        for i in (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
        if isinstance(i, int) and i != tokenizer.unk_token_id
    ] or [tokenizer.eos_token_id]
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=eos,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(dtype).eval()


def build_tiny(
    *, seed: int = 0, hidden: int = 128, layers: int = 2
) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """The built-in tiny model (random weights) and its tokenizer: what :data:`TINY` names."""
    tokenizer = build_tiny_tokenizer()
    return build_tiny_model(tokenizer, hidden=hidden, layers=layers, seed=seed), tokenizer


TINY = "tiny"
"""The model name that picks the built-in tiny model and tokenizer: ``LocalRL("tiny")``,
``model: tiny`` in ``voltrl train``'s YAML, ``voltrl model serve tiny``. Its weights are
random, so an agent's rewards stay near 0: it proves the plumbing, not learning."""
