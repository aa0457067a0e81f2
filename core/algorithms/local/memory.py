"""What LocalRL will hold in memory, estimated once its model is loaded and before anything
else is allocated: printed when a run starts, and a run that cannot fit its device is
refused then, in one message, rather than minutes later by an out-of-memory error.

The parts: the policy's weights; the engine's copy of them (it serves while the policy
trains); a frozen reference copy (``kl_coef > 0`` without LoRA); the gradients of the
trained weights, their float32 master copies when the weights are in half precision
(:mod:`~voltrl.models.precision`) and AdamW's two float32 moments; the engine's KV cache for
``max_batch_size`` sequences of ``sequence_tokens``: what the run samples, a prompt of
:data:`PROMPT_TOKENS` and ``max_tokens`` (at most the model's context). The built-in engine
grows its cache with the sequences it holds, so that is the most it reaches. With an SFT warm
start before LoRA, the warm-up's full fine-tuning is the peak when it is larger.

The update's activations grow with ``micro_batch_size`` and the rows' length, quadratically
with attention, and often outweigh everything else: SmolLM2-135M's update on micro-batches of
16 rows of 300 tokens keeps 11.6 GiB (measured), where its weights are 0.5 GiB. They are
estimated once the first batch is built and its rows' lengths are known
(:func:`activation_bytes`, :func:`check_activations`), and said when they cannot fit, with
the ``micro_batch_size`` that would. Not counted anywhere: the transient copy that merging LoRA
adapters for the engine makes, and the allocator's slack.

On a GPU a run the estimate says cannot fit is refused; on a CPU (the kernel can swap) it is a
warning. Each step logs the run's measured peak (``memory/peak_gib``, reset when the run loads
its model).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from voltrl.errors import VoltRLError
from voltrl.models.precision import resolve_dtype

GB = 1024**3
CONTEXT_TOKENS = 4096
"""Tokens per sequence the KV-cache estimate assumes when a run sets no ``max_tokens``."""
PROMPT_TOKENS = 1024
"""The prompt tokens the KV-cache estimate assumes before a run's ``max_tokens``."""


@dataclass
class MemoryEstimate:
    """Bytes by part (see the module docstring)."""

    parts: dict[str, int]
    note: str = ""
    """What the peak is, when not the RL steps (the SFT warm-up's full fine-tuning)."""
    kv_note: str = ""
    """What the KV cache holds (``KV cache: 64 sequences of 1,088 tokens``)."""

    @property
    def total(self) -> int:
        """All parts together."""
        return sum(self.parts.values())

    def line(self) -> str:
        """The estimate in one line: ``memory estimate: 8.1 GiB (weights 1.0, ...)``."""
        shown = ", ".join(f"{k} {v / GB:.2f}" for k, v in self.parts.items() if v)
        peak = f" at {self.note}" if self.note else ""
        kv = f"; {self.kv_note}" if self.kv_note and "KV cache" in self.parts else ""
        return (
            f"memory estimate{peak}: {self.total / GB:.2f} GiB ({shown}{kv}; the update's "
            "activations are estimated at the first step)"
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
    sequence_tokens: int = CONTEXT_TOKENS,
    served_dtype: Any = None,
) -> MemoryEstimate:
    """LocalRL's memory for ``model`` (loaded) trained with ``update`` (a
    ``PolicyUpdateConfig``); ``adapters``: named LoRA adapters (0: one, or full fine-tuning);
    ``warm_start``: an SFT warm-up trains every weight first (its peak counts when larger);
    ``sequence_tokens``: the longest sequence (prompt and reply) the engine holds, at most the
    model's context; ``served_dtype``: the engine's copy's torch dtype when it is not the
    model's (``serving.dtype``), which its KV cache takes too."""
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
    sequence_tokens = min(sequence_tokens, getattr(config, "max_position_embeddings", 0) or 10**9)
    layers = getattr(config, "num_hidden_layers", 0)
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = 2 * layers * kv_heads * head_dim * served * sequence_tokens * max_batch_size
    rl = {
        "weights": weights,
        "engine copy": (count + (trainable if update.use_lora else 0)) * served,
        "reference copy": weights if update.kl_coef > 0 and not update.use_lora else 0,
        "gradients": trainable * 4,  # float32: adapters', masters' or float32 weights' own
        "master weights": trainable * master,
        "optimizer": trainable * 8,
        "KV cache": kv,
    }
    note = f"KV cache: {max_batch_size} sequences of {sequence_tokens:,} tokens"
    if warm_start and update.use_lora:  # SFT trains every weight first, before any copy
        warm = {"weights": weights, "gradients": count * 4, "optimizer": count * 8}
        warm["master weights"] = count * 4 if width < 4 else 0
        if sum(warm.values()) > sum(rl.values()):
            return MemoryEstimate(warm, note="the SFT warm-up's full fine-tuning")
    return MemoryEstimate(rl, kv_note=note)


def free_bytes(device: Any) -> int | None:
    """Memory ``device`` has free now (CUDA: the driver's figure, plus what torch's allocator
    holds cached but unused, which it hands out again; CPU: the kernel's ``MemAvailable``), or
    None where it cannot be told."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + cached
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
    biggest = max(found.parts, key=lambda k: found.parts[k])
    fix = (
        "lower serving.max_batch_size or the sampling's max_tokens"
        if biggest == "KV cache"
        else "train a LoRA adapter (update={'use_lora': True}), load the model in bfloat16 "
        "(dtype='bfloat16'), or lower serving.max_batch_size"
    )
    message = (
        f"this LocalRL run needs about {needed / GB:.1f} GiB more on {device} and "
        f"{free / GB:.1f} GiB is free ({found.line()}). The largest part is the {biggest}: "
        f"{fix}"
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


def sequence_tokens(sampling: dict[str, Any]) -> int:
    """The longest sequence a run's ``sampling`` lets the engine hold: :data:`PROMPT_TOKENS`
    and its ``max_tokens`` (or ``max_completion_tokens``), else :data:`CONTEXT_TOKENS`."""
    limit = sampling.get("max_tokens") or sampling.get("max_completion_tokens")
    return PROMPT_TOKENS + int(limit) if limit else CONTEXT_TOKENS


def check_memory(model: Any, local_rl: Any, report: bool) -> None:
    """Estimate the memory ``local_rl`` (a LocalRL) will hold for ``model`` (just loaded),
    print it when ``report``, and refuse the run (:func:`check_fits`) when its GPU cannot hold
    it (warn on a CPU)."""
    adapters = local_rl.adapters
    longest = max(sequence_tokens(local_rl.sampling), sequence_tokens(local_rl.val_sampling))
    found = estimate(
        model,
        local_rl.update,
        max_batch_size=local_rl.serving.max_batch_size,
        adapters=len(adapters.names) if adapters is not None else 0,
        warm_start=local_rl.warm_start is not None,
        sequence_tokens=longest,
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


ACTIVATION_FLOATS = (12, 4, 2, 6)
"""The floats the update's backward keeps, fitted to SmolLM2-135M in float32 with LoRA on
every linear layer (micro-batches of 4 to 16 rows of 150 to 300 tokens, measured with
``VmHWM``; within 12%): per token and layer, 12 per hidden unit, 4 per MLP unit and 2 per
attention head and token attended to; per row, 6 per vocabulary entry and response token (the
logits, their log-softmax and entropy, and their gradients)."""
CHECKPOINTED = 0.4
"""What gradient checkpointing keeps of the activations, measured on the same model (11.1 ->
4.4 GiB for 16 rows of 300 tokens)."""


def activation_bytes(
    config: Any, rows: int, tokens: int, response_tokens: int, *, checkpointing: bool = False
) -> int:
    """About what the update's forward keeps for its backward, for one micro-batch of ``rows``
    rows of ``tokens`` tokens (``response_tokens`` of them scored) of a model with
    ``config`` (:data:`ACTIVATION_FLOATS`; :data:`CHECKPOINTED` of it with gradient
    checkpointing)."""
    hidden_f, mlp_f, head_f, vocab_f = ACTIVATION_FLOATS
    layers = getattr(config, "num_hidden_layers", 1)
    heads = getattr(config, "num_attention_heads", 1)
    mlp = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    per_token = layers * (hidden_f * config.hidden_size + mlp_f * mlp + head_f * heads * tokens)
    per_row = vocab_f * config.vocab_size * response_tokens
    floats = rows * (tokens * per_token + per_row)
    return int(4 * floats * (CHECKPOINTED if checkpointing else 1.0))


def micro_batch_activations(
    model: Any,
    batch: Any,
    micro_batch_size: int,
    max_tokens: int | None = None,
    checkpointing: bool = False,
) -> tuple[int, int, int]:
    """``(bytes, rows, tokens)`` of the largest micro-batch of ``batch`` (a
    ``TrainingBatch``): ``micro_batch_size`` rows (fewer under ``max_tokens`` a micro-batch) as
    long as its longest row (:func:`activation_bytes`)."""
    longest = max((sum(mask) for mask in batch.attention_mask), default=0)
    rows = min(micro_batch_size, len(batch))
    if max_tokens:
        rows = max(1, min(rows, max_tokens // max(longest, 1)))
    found = activation_bytes(
        model.config, rows, longest, batch.response_length, checkpointing=checkpointing
    )
    return found, rows, longest


def check_activations(
    model: Any,
    batch: Any,
    micro_batch_size: int,
    *,
    max_tokens: int | None = None,
    checkpointing: bool | None = None,
    what: str = "update",
) -> str:
    """One line on the activations of ``what`` for ``batch``: LocalRL's ``update``
    (``checkpointing``: its ``gradient_checkpointing``), or ``"SFT"``'s warm-up (``None``: it
    has no such setting). A warning, with the ``micro_batch_size`` that would fit, when they
    exceed what ``model``'s device has free."""
    found, rows, longest = micro_batch_activations(
        model, batch, micro_batch_size, max_tokens, bool(checkpointing)
    )
    owner = "the update's" if what == "update" else f"{what}'s"
    line = (
        f"memory: {owner} activations, about {found / GB:.2f} GiB for micro-batches of "
        f"{rows} rows of up to {longest:,} tokens"
    )
    free = free_bytes(next(model.parameters()).device)
    if free is None or found <= free:
        return line
    fits = max(1, int(rows * free * 0.8 / found))
    hint = ", or update.gradient_checkpointing=True" if checkpointing is False else ""
    setting = "update.micro_batch_size" if what == "update" else f"{what}(micro_batch_size=...)"
    return (
        f"warning: {line}, and {free / GB:.2f} GiB is free: set {setting} to "
        f"{fits} (micro-batches add up to the same gradient){hint}"
    )


def say_activations(
    policies: dict[str | None, Any], update: Any, parts: dict[str | None, Any], progress: bool
) -> None:
    """Print :func:`check_activations` for LocalRL's first update (``parts``: each trainer's
    batch; the largest counts): always when it is a warning, else when ``progress``."""
    key, part = max(parts.items(), key=lambda kv: len(kv[1]))
    line = check_activations(
        policies[key].model,
        part,
        update.micro_batch_size,
        max_tokens=update.max_tokens_per_micro_batch,
        checkpointing=update.gradient_checkpointing,
    )
    if progress or line.startswith("warning"):
        print(line, flush=True)


def peak_memory(policies: dict[str | None, Any]) -> dict[str, float]:
    """``{"memory/peak_gib": ...}`` for a step's metrics (:func:`peak_gib` of the trainers'
    device), or nothing where it cannot be told."""
    peak = peak_gib(next(iter(policies.values())).device)
    return {} if peak is None else {"memory/peak_gib": peak}


def reset_peak(device: Any) -> None:
    """Start the process's peak memory (:func:`peak_gib`) over from what it holds now, so a
    run's ``memory/peak_gib`` is its own, not an earlier run's in the same process (a
    benchmark's arms, a notebook): on CUDA the allocator's peak, elsewhere ``VmHWM`` (Linux's
    ``clear_refs``; left as it is where that cannot be written)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_gib(device: Any) -> float | None:
    """The process's peak memory so far, in GiB: on CUDA the allocator's peak, elsewhere the
    resident set's high-water mark (``VmHWM``); None where it cannot be told."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GB
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        return None
    return None
