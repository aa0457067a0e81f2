"""A small continuous-batching inference engine for a Hugging Face causal LM (CPU or one GPU).

The model runs on one dedicated thread. Requests arrive from any event loop
(:meth:`Engine.stream`, :meth:`Engine.generate`) and join the running batch at the next step
boundary: their prompts are prefilled together (left-padded, with attention masks and position
ids), each prompt's KV cache is repeated for its ``n`` choices, and the rows are merged into the
batch's ``DynamicCache``. Every step then decodes one token for every running choice in one
forward pass; finished choices leave the batch at once and the cache's all-padding columns are
trimmed.

Requests are described by :class:`~.sampling.SamplingParams` and answered with
:class:`~.sampling.Choice` deltas and :class:`~.sampling.RequestOutput`s (re-exported here);
:mod:`.sampling` samples the tokens and documents the ``logprobs`` / ``sampling_logprobs``
semantics. The parts: :mod:`.core` (the :class:`Engine`: its thread, requests, weights),
:mod:`.batch` (the running batch's KV cache), :mod:`.sequences` (each choice's tokens, text
and stop conditions), :mod:`.sampling`.

Text follows vLLM: special tokens are skipped, a stop string ends generation and is cut from the
text (with the rest of the text after it), and EOS / ``stop_token_ids`` tokens are kept in
``token_ids`` (they were sampled, the trainer needs them) but not in the text.

:meth:`Engine.update_weights` swaps weights at a step boundary; choices in flight go on with
the new weights (their cached keys and values stay); ``Engine.weights_version`` counts the
updates loaded.

**LoRA adapters.** Given a ``peft`` model holding several LoRA adapters (one per agent role)
and ``lora_adapters=True``, the engine serves them all at once: each request names its adapter
(``adapter=``; None: the base model), and requests for different adapters share one decode
batch: a forward pass runs the base weights once for every row and each adapter's low-rank
update on its own rows (peft's mixed-adapter batches). ``update_weights(state,
adapter=name)`` swaps one adapter's weights and leaves the others, and the base, as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl.serving.engine.core import Engine
from voltrl.serving.engine.sampling import (
    MAX_TOP_LOGPROBS,
    Choice,
    FinishReason,
    RequestOutput,
    SamplingParams,
)
from voltrl.serving.engine.sequences import EngineError

if TYPE_CHECKING:
    from voltrl.serving.engine.vllm import VLLMEngine

__all__ = [
    "MAX_TOP_LOGPROBS",
    "Choice",
    "Engine",
    "EngineError",
    "FinishReason",
    "RequestOutput",
    "SamplingParams",
    "start_engine",
]


def start_engine(
    kind: str,
    model: Any,
    tokenizer: Any,
    directory: Path,
    *,
    max_batch_size: int,
    seed: int | None,
    lora_adapters: bool = False,
    engine_args: Mapping[str, Any] | None = None,
    report: bool = False,
) -> Engine | VLLMEngine:
    """The engine LocalRL serves ``model`` with: ``kind`` ``"local"``, an :class:`Engine`
    (serving ``lora_adapters`` by name when asked); ``"vllm"``, a
    :class:`~.vllm.VLLMEngine` on ``model``'s device, started from a copy saved in
    ``directory``. ``report``: print :func:`~voltrl.serving.choice.engine_hint` where it has one."""
    from voltrl.serving.choice import engine_hint

    if report and (hint := engine_hint(kind, str(next(model.parameters()).device))):
        print(hint, flush=True)
    if kind == "vllm":
        from voltrl.serving.engine.vllm import vllm_engine_for

        device = str(next(model.parameters()).device)
        return vllm_engine_for(
            model,
            tokenizer,
            directory,
            device=device,
            max_batch_size=max_batch_size,
            seed=seed,
            engine_args=engine_args,
        )
    return Engine(
        model, tokenizer, max_batch_size=max_batch_size, seed=seed, lora_adapters=lora_adapters
    )
