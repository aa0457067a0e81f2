"""LocalRL's memory estimate (core/algorithms/local/memory.py) for Qwen2.5 0.5B, 1.5B and 7B,
full fine-tuning and LoRA (rank 16, all linear layers), in bfloat16 and float32, with the
engine's KV cache for 64 sequences of 4,096 tokens: the table in docs/memory.md. The models are
built on torch's meta device (no weights, no download), so it runs anywhere in seconds.

    python benchmarks/memory_table.py

On a GPU, a run's measured peak is torch.cuda.max_memory_allocated() after its first steps
(benchmarks/gpu_probe.py, when it exists, prints it); here there is none to measure.
"""

from __future__ import annotations

import torch
import transformers

from voltrl.algorithms.local.memory import GB, estimate
from voltrl.algorithms.local.update_config import PolicyUpdateConfig

SHAPES = {  # Qwen2.5-*-Instruct's config.json
    "0.5B": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "1.5B": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "7B": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
           "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False},
}  # fmt: skip


def rows(max_batch_size: int = 64) -> list[tuple[str, str, str, float, float]]:
    """``(model, training, dtype, estimate GiB, of which KV cache GiB)`` for every shape."""
    out = []
    for name, shape in SHAPES.items():
        config = transformers.Qwen2Config(vocab_size=151936, **shape)
        with torch.device("meta"):
            model = transformers.Qwen2ForCausalLM(config)
        for dtype in (torch.bfloat16, torch.float32):
            model = model.to(dtype)
            for lora in (False, True):
                update = PolicyUpdateConfig(use_lora=lora)
                found = estimate(model, update, max_batch_size=max_batch_size)
                kind = "LoRA r16" if lora else "full"
                dtype_name = str(dtype).removeprefix("torch.")
                out.append((name, kind, dtype_name, found.total / GB, found.parts["KV cache"] / GB))
    return out


def main() -> None:
    print("| model | training | dtype | estimate (GiB) | of which KV cache |")
    print("|---|---|---|---|---|")
    for name, kind, dtype, total, kv in rows():
        print(f"| Qwen2.5-{name} | {kind} | {dtype} | {total:.1f} | {kv:.1f} |")


if __name__ == "__main__":
    main()
