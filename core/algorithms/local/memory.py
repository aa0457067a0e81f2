"""What LocalRL will hold in memory, estimated once its model is loaded and before anything
else is allocated: printed when a run starts, and a run that cannot fit its device is
refused then, in one message, rather than minutes later by an out-of-memory error.

The parts: the policy's weights; the engine's copy of them (it serves while the policy
trains); a frozen reference copy (``kl_coef > 0`` without LoRA); the gradients of the
trained weights, their float32 master copies when the weights are in half precision
(:mod:`~voltrl.models.precision`) and AdamW's two float32 moments; the engine's
KV cache with ``max_batch_size`` sequences of ``context_tokens`` (at most the model's
context). With an SFT warm start before LoRA, the warm-up's full fine-tuning is the peak when
it is larger. Not counted: the update's activations, which grow with ``micro_batch_size`` and
sequence length (``gradient_checkpointing=True`` cuts them), the transient copy that merging
LoRA adapters for the engine makes, and the allocator's slack: the estimate is a floor.

On a GPU a run the estimate says cannot fit is refused; on a CPU (its KV cache there is an
upper bound, and the kernel can swap) it is a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from voltrl.errors import VoltRLError
from voltrl.models.precision import resolve_dtype

GB = 1024**3
CONTEXT_TOKENS = 4096
"""Tokens per sequence the KV-cache estimate assumes (prompt and reply)."""


@dataclass
class MemoryEstimate:
    """Bytes by part (see the module docstring)."""

    parts: dict[str, int]
    note: str = ""
    """What the peak is, when not the RL steps (the SFT warm-up's full fine-tuning)."""

    @property
    def total(self) -> int:
        """All parts together."""
        return sum(self.parts.values())

    def line(self) -> str:
        """The estimate in one line: ``memory estimate: 8.1 GiB (weights 1.0, ...)``."""
        shown = ", ".join(f"{k} {v / GB:.2f}" for k, v in self.parts.items() if v)
        peak = f" at {self.note}" if self.note else ""
        return (
            f"memory estimate{peak}: {self.total / GB:.2f} GiB ({shown}; activations not counted)"
        )


def lora_parameters(model: Any, r: int, targets: list[str] | str, adapters: int = 1) -> int:
    """Parameters ``adapters`` LoRA adapters of rank ``r`` add to ``model``'s linear layers
    (``"all-linear"``: every one but the output head; else those whose name ends with one of
    ``targets``)."""
    import torch

    output = model.get_output_embeddings()
    total = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is output:
            continue
        if targets != "all-linear" and not any(name.endswith(t) for t in targets):
            continue
        total += r * (module.in_features + module.out_features)
    return total * adapters


def estimate(
    model: Any,
    update: Any,
    *,
    max_batch_size: int,
    adapters: int = 0,
    warm_start: bool = False,
    context_tokens: int = CONTEXT_TOKENS,
    served_dtype: Any = None,
) -> MemoryEstimate:
    """LocalRL's memory for ``model`` (loaded) trained with ``update`` (a
    ``PolicyUpdateConfig``); ``adapters``: named LoRA adapters (0: one, or full fine-tuning);
    ``warm_start``: an SFT warm-up trains every weight first (its peak counts when larger);
    ``served_dtype``: the engine's copy's torch dtype when it is not the model's
    (``serving.dtype``), which its KV cache takes too."""
    import torch

    params = list(model.parameters())
    width = torch.finfo(params[0].dtype).bits // 8
    served = width if served_dtype is None else torch.finfo(served_dtype).bits // 8
    count = sum(p.numel() for p in params)
    weights = count * width
    if update.use_lora:
        trainable = lora_parameters(
            model, update.lora_r, update.lora_target_modules, max(1, adapters)
        )
    else:
        trainable = count
    master = 4 if width < 4 and not update.use_lora else 0  # peft keeps adapters in float32
    config = model.config
    context_tokens = min(context_tokens, getattr(config, "max_position_embeddings", 0) or 10**9)
    layers = getattr(config, "num_hidden_layers", 0)
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = 2 * layers * kv_heads * head_dim * served * context_tokens * max_batch_size
    rl = {
        "weights": weights,
        "engine copy": (count + (trainable if update.use_lora else 0)) * served,
        "reference copy": weights if update.kl_coef > 0 and not update.use_lora else 0,
        "gradients": trainable * 4,  # float32: adapters', masters' or float32 weights' own
        "master weights": trainable * master,
        "optimizer": trainable * 8,
        "KV cache": kv,
    }
    if warm_start and update.use_lora:  # SFT trains every weight first, before any copy
        warm = {"weights": weights, "gradients": count * 4, "optimizer": count * 8}
        warm["master weights"] = count * 4 if width < 4 else 0
        if sum(warm.values()) > sum(rl.values()):
            return MemoryEstimate(warm, note="the SFT warm-up's full fine-tuning")
    return MemoryEstimate(rl)


def free_bytes(device: Any) -> int | None:
    """Memory ``device`` has free now (CUDA: the driver's figure; CPU: the kernel's
    ``MemAvailable``), or None where it cannot be told."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def check_fits(found: MemoryEstimate, device: Any, loaded: int) -> str | None:
    """When ``found`` (of which ``loaded`` bytes, the policy's weights, are allocated
    already) cannot fit what ``device`` has free: on a GPU raise :class:`VoltRLError`, on a
    CPU return a warning; either says what would fit. None when it fits."""
    import torch

    free = free_bytes(device)
    needed = found.total - loaded
    if free is None or needed <= free:
        return None
    message = (
        f"this LocalRL run needs about {needed / GB:.1f} GiB more on {device} and "
        f"{free / GB:.1f} GiB is free ({found.line()}). Train a LoRA adapter "
        "(update={'use_lora': True}), load the model in bfloat16 (dtype='bfloat16'), or lower "
        "max_batch_size"
    )
    if torch.device(device).type == "cpu":
        return f"warning: {message}"
    raise VoltRLError(message)


def with_vllm(
    found: MemoryEstimate, device: Any, engine_args: dict[str, Any] | None
) -> MemoryEstimate:
    """``found`` with vLLM serving (``LocalRL(engine="vllm")``) instead of the built-in
    engine. On a GPU, vLLM's share of the card (``gpu_memory_utilization``: its weights, CUDA
    graphs and KV cache) replaces the engine's copy and KV cache, since LocalRL keeps its own
    copy of the served weights on the CPU. On a CPU, vLLM's weights and its KV cache
    (``kv_cache_memory_bytes``) replace the KV cache, beside that copy."""
    import torch

    from voltrl.serving.engine.vllm import (
        DEFAULT_CPU_KV_CACHE_BYTES,
        DEFAULT_GPU_MEMORY_UTILIZATION,
    )

    args = engine_args or {}
    parts = {k: v for k, v in found.parts.items() if k != "KV cache"}
    device = torch.device(device)
    if device.type == "cuda":
        del parts["engine copy"]
        share = args.get("gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION)
        total = torch.cuda.get_device_properties(device).total_memory
        parts[f"vLLM ({share:.0%} of the card)"] = int(share * total)
    else:
        kv = args.get("kv_cache_memory_bytes", DEFAULT_CPU_KV_CACHE_BYTES)
        parts["vLLM (weights and KV cache)"] = found.parts["weights"] + kv
    return MemoryEstimate(parts, found.note)


def check_memory(model: Any, local_rl: Any, report: bool) -> None:
    """Estimate the memory ``local_rl`` (a LocalRL) will hold for ``model`` (just loaded),
    print it when ``report``, and refuse the run (:func:`check_fits`) when its GPU cannot hold
    it (warn on a CPU)."""
    adapters = local_rl.adapters
    found = estimate(
        model,
        local_rl.update,
        max_batch_size=local_rl.serving.max_batch_size,
        adapters=len(adapters.names) if adapters is not None else 0,
        warm_start=local_rl.warm_start is not None,
        served_dtype=None
        if local_rl.serving.dtype is None
        else resolve_dtype(local_rl.serving.dtype, next(model.parameters()).device),
    )
    device = next(model.parameters()).device
    if local_rl.serving.engine == "vllm":
        found = with_vllm(found, device, local_rl.serving.engine_args)
    if report:
        print(f"{found.line()} on {device}", flush=True)
    if warning := check_fits(found, device, found.parts["weights"]):
        print(warning, flush=True)
