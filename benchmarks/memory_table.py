"""LocalRL's memory estimate (core/algorithms/local/memory.py) for Qwen2.5 0.5B, 1.5B and 7B,
full fine-tuning and LoRA (rank 16, all linear layers), in bfloat16 and float32, with the
engine's KV cache for 64 sequences of 4,096 tokens: the table in docs/memory.md. The models are
built on torch's meta device (no weights, no download), so it runs anywhere in seconds.

    python benchmarks/memory_table.py

``--measure`` (on a GPU) also builds each shape in bfloat16 with random weights, as LocalRL
holds it without its KV cache (the engine's copy, a reference copy when the KL needs one) and
runs two policy updates on 8 rows of 1,024 tokens (micro-batches of 4, gradient checkpointing),
printing the peak of ``torch.cuda.max_memory_allocated()`` beside the estimate less its KV cache
(the built-in engine grows its cache with the sequences it holds). A shape that cannot fit
prints the out-of-memory error instead.

    python benchmarks/memory_table.py --measure [--shapes 0.5B 1.5B 7B]
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_probe import voltrl_from_the_tree  # a GPU machine has this tree, no install

voltrl_from_the_tree()

from voltrl.algorithms.local.memory import GB, estimate  # noqa: E402
from voltrl.algorithms.local.update_config import PolicyUpdateConfig  # noqa: E402

SHAPES = {  # Qwen2.5-*-Instruct's config.json
    "0.5B": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "1.5B": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "7B": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
           "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False},
    "small": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
}  # fmt: skip
"""``small`` is for a CPU (the tests): it is not in the docs' table, and measures on rows of 128
tokens, not 1,024 (bfloat16 on a CPU is slow; the code path is the same)."""
TABLE_SHAPES = ("0.5B", "1.5B", "7B")


def rows(max_batch_size: int = 64) -> list[tuple[str, str, str, float, float]]:
    """``(model, training, dtype, estimate GiB, of which KV cache GiB)`` for every shape."""
    out = []
    for name in TABLE_SHAPES:
        config = transformers.Qwen2Config(vocab_size=151936, **SHAPES[name])
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


def measure(name: str, lora: bool, device: str) -> tuple[float, float | None, str]:
    """``(estimate less KV cache GiB, measured peak GiB or None, note)`` for one shape in
    bfloat16: the model, the engine's copy, and two policy updates (the first builds the
    optimizer's state)."""
    from voltrl.algorithms.local.update import PolicyTrainer
    from voltrl.trajectory import collate
    from voltrl.types import Trajectory, Transition

    vocab = 151936 if name != "small" else 256
    config = transformers.Qwen2Config(vocab_size=vocab, pad_token_id=0, **SHAPES[name])
    update = PolicyUpdateConfig(
        use_lora=lora, micro_batch_size=4, gradient_checkpointing=True, lr=1e-6
    )
    with torch.device("meta"):
        found = estimate(
            transformers.Qwen2ForCausalLM(config).to(torch.bfloat16), update, max_batch_size=64
        )
    expected = (found.total - found.parts["KV cache"]) / GB
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    prompt, response = (32, 96) if name == "small" else (256, 768)
    rng = random.Random(0)
    rows = [
        Trajectory(
            rollout_id=f"r{i}",
            task_id=f"t{i // 4}",
            transitions=[
                Transition(
                    prompt_token_ids=[rng.randrange(1, vocab) for _ in range(prompt)],
                    response_token_ids=[rng.randrange(1, vocab) for _ in range(response)],
                    reward=float(i % 2),
                )
            ],
        )
        for i in range(8)
    ]
    model = served = trainer = None
    try:
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # built in bfloat16: no float32 copy first
        try:
            with torch.device(device):
                model = transformers.Qwen2ForCausalLM(config)
        finally:
            torch.set_default_dtype(default)
        served = copy.deepcopy(model).requires_grad_(False)  # the engine's copy
        trainer = PolicyTrainer(model.train(), update)
        for _ in range(2):
            trainer.step(collate(copy.deepcopy(rows)))
        peak = torch.cuda.max_memory_allocated() / GB if device.startswith("cuda") else None
        return expected, peak, ""
    except torch.OutOfMemoryError as exc:
        return expected, None, f"out of memory: {str(exc).splitlines()[0][:120]}"
    finally:
        del model, served, trainer
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="measure peaks (a GPU)")
    parser.add_argument("--shapes", nargs="+", default=list(TABLE_SHAPES), choices=SHAPES)
    args = parser.parse_args(argv)
    if not args.measure:
        print("| model | training | dtype | estimate (GiB) | of which KV cache |")
        print("|---|---|---|---|---|")
        for name, kind, dtype, total, kv in rows():
            print(f"| Qwen2.5-{name} | {kind} | {dtype} | {total:.1f} | {kv:.1f} |")
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"measured on {torch.cuda.get_device_name() if device == 'cuda' else 'a CPU'}")
    print("| model | training | estimate less KV cache (GiB) | measured peak (GiB) |")
    print("|---|---|---|---|")
    for name in args.shapes:
        for lora in (False, True):
            expected, peak, note = measure(name, lora, device)
            shown = note or ("-" if peak is None else f"{peak:.1f}")
            kind = "LoRA r16" if lora else "full"
            print(f"| {name} | {kind} | {expected:.1f} | {shown} |", flush=True)


if __name__ == "__main__":
    main()
