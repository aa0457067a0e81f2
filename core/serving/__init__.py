"""Serving: a model behind an OpenAI-compatible endpoint, with the exact sampled token ids.

:mod:`.engine` generates: the built-in continuous-batching engine (:mod:`.engine.core`, its
prefix cache in :mod:`.engine.prefix_cache`) or vLLM in this process (:mod:`.engine.vllm`),
behind one front (:mod:`.engine.front`). :mod:`.openai_api` is the HTTP server in front of an
engine (``/v1/chat/completions``, ``/v1/completions``); :mod:`.choice` checks which engine a
run asks for, without importing torch. ``voltrl model serve`` serves a model with these alone;
LocalRL adds weight swaps between its updates. Below it: :mod:`voltrl.models`.
"""
