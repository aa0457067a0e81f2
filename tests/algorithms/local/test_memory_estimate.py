"""LocalRL's memory estimate: its parts add up from the model's own tensors, its LoRA count is
what peft really adds, and a run that cannot fit its device is refused with what would fit."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
from helpers import ROOT
from tiny_batches import tiny_model, varied_batch

from voltrl.algorithms.local.memory import (
    MemoryEstimate,
    check_fits,
    estimate,
    free_bytes,
    lora_parameters,
)
from voltrl.algorithms.local.update import PolicyTrainer, PolicyUpdateConfig

sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_fine_tuning_counts_weights_twice_gradients_masters_adam_and_the_kv_cache(
    dtype: torch.dtype,
) -> None:
    model = tiny_model().to(dtype)
    n = sum(p.numel() for p in model.parameters())
    width = 4 if dtype == torch.float32 else 2
    found = estimate(model, PolicyUpdateConfig(), max_batch_size=8, sequence_tokens=100)
    c = model.config
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // 4) * width * 800
    assert found.parts == {
        "weights": n * width,
        "engine copy": n * width,
        "reference copy": 0,
        "gradients": n * 4,  # accumulated in float32 (in the masters, for bfloat16)
        "master weights": 0 if width == 4 else n * 4,
        "optimizer": n * 8,
        "KV cache": kv,
    }
    with_kl = estimate(model, PolicyUpdateConfig(kl_coef=0.1), max_batch_size=8)
    assert with_kl.parts["reference copy"] == n * width
    # served in bfloat16 (serving.dtype): the engine's copy and its KV cache take 2 bytes
    served = estimate(
        model,
        PolicyUpdateConfig(),
        max_batch_size=8,
        sequence_tokens=100,
        served_dtype=torch.bfloat16,
    )
    assert served.parts["engine copy"] == n * 2 and served.parts["KV cache"] == kv * 2 // width
    assert served.parts["weights"] == n * width


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_the_lora_count_is_what_peft_adds(targets: list[str] | str) -> None:
    config = PolicyUpdateConfig(use_lora=True, lora_r=8, lora_target_modules=targets)
    expected = lora_parameters(tiny_model(), 8, targets)
    trainer = PolicyTrainer(tiny_model(), config)
    assert expected == sum(p.numel() for p in trainer.params) > 0
    found = estimate(tiny_model(), config, max_batch_size=1)
    assert found.parts["gradients"] == 4 * expected and found.parts["optimizer"] == 8 * expected


def test_a_run_that_cannot_fit_is_a_warning_on_a_cpu_saying_what_would_fit() -> None:
    free = free_bytes("cpu")
    assert free is not None and free > 0
    assert check_fits(MemoryEstimate({"weights": 10, "optimizer": 10}), "cpu", loaded=10) is None
    too_big = MemoryEstimate({"weights": 10, "optimizer": free * 2})
    warning = check_fits(too_big, "cpu", loaded=10) or ""
    assert re.match(r"warning: this LocalRL run needs about .* GiB more on cpu ", warning)
    assert "'use_lora': True" in warning and "dtype='bfloat16'" in warning
    kv_heavy = MemoryEstimate({"weights": 10, "KV cache": free * 2})
    warning = check_fits(kv_heavy, "cpu", loaded=10) or ""
    assert "the KV cache: lower serving.max_batch_size or the sampling's max_tokens" in warning


def test_an_sft_warm_start_before_lora_is_the_peak_when_it_is_larger() -> None:
    model = tiny_model().to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    lora = PolicyUpdateConfig(use_lora=True)
    found = estimate(model, lora, max_batch_size=1, sequence_tokens=1, warm_start=True)
    assert found.note == "the SFT warm-up's full fine-tuning"
    assert found.parts == {"weights": 2 * n, "gradients": 4 * n, "optimizer": 8 * n,
                           "master weights": 4 * n}  # fmt: skip
    assert found.line().startswith("memory estimate at the SFT warm-up's full fine-tuning: ")
    assert estimate(model, lora, max_batch_size=1).note == ""


def test_the_docs_table_is_what_the_estimate_gives_for_qwen25() -> None:
    from memory_table import rows

    table = {(m, kind, dtype): round(total, 1) for m, kind, dtype, total, _ in rows()}
    docs = (ROOT / "docs" / "memory.md").read_text()
    for (model, kind, dtype), total in table.items():
        assert f"| Qwen2.5-{model} | {kind} | {dtype} | {total:.1f} |" in docs
    assert table[("7B", "LoRA r16", "bfloat16")] < 80  # a 7B model with LoRA fits one card


@pytest.mark.slow
def test_the_measured_table_runs_two_updates_of_each_kind_on_a_cpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from memory_table import main

    main(["--measure", "--shapes", "small"])
    out = capsys.readouterr().out
    assert "| small | full | 0.0 | - |" in out  # no peak to read without CUDA
    assert "| small | LoRA r16 | 0.0 | - |" in out


def test_with_vllm_on_a_cpu_its_weights_and_kv_cache_replace_the_built_in_cache() -> None:
    from voltrl.algorithms.local.memory import with_vllm

    model = tiny_model()
    found = estimate(model, PolicyUpdateConfig(), max_batch_size=4)
    vllm = with_vllm(found, "cpu", {"kv_cache_memory_bytes": 1000})
    assert "KV cache" not in vllm.parts
    assert vllm.parts["engine copy"] == found.parts["engine copy"]  # LocalRL's copy for final/
    assert vllm.parts["vLLM (weights and KV cache)"] == found.parts["weights"] + 1000


def test_the_kv_cache_is_sized_to_the_runs_prompt_and_max_tokens() -> None:
    from voltrl.algorithms.local.memory import PROMPT_TOKENS, sequence_tokens

    assert sequence_tokens({"max_tokens": 64}) == PROMPT_TOKENS + 64
    assert sequence_tokens({"max_completion_tokens": 32}) == PROMPT_TOKENS + 32
    assert sequence_tokens({}) == 4096  # no limit: the model's context, up to 4,096
    model = tiny_model()
    found = estimate(model, PolicyUpdateConfig(), max_batch_size=8, sequence_tokens=100)
    assert "KV cache: 8 sequences of 100 tokens" in found.line()


def test_the_activation_estimate_is_what_smollm2s_update_measured() -> None:
    """The fit's data points (SmolLM2-135M, float32, LoRA on every linear layer: ``VmHWM``
    less the model's, measured by a forward and backward of ``token_logprobs``)."""
    from types import SimpleNamespace

    from voltrl.algorithms.local.memory import GB, activation_bytes

    smollm2 = SimpleNamespace(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        vocab_size=49152,
    )
    for rows, tokens, measured in ((4, 300, 2.78), (16, 300, 11.11), (8, 150, 3.06)):
        found = activation_bytes(smollm2, rows, tokens, 64) / GB
        assert abs(found - measured) / measured < 0.15, (rows, tokens, found)
    checkpointed = activation_bytes(smollm2, 16, 300, 64, checkpointing=True) / GB
    assert abs(checkpointed - 4.39) / 4.39 < 0.15


def test_micro_batches_that_cannot_fit_get_a_warning_with_the_size_that_would() -> None:
    from voltrl.algorithms.local.memory import check_activations, micro_batch_activations

    batch = varied_batch()
    model = tiny_model()
    small = check_activations(model, batch, 2, checkpointing=False)
    assert small.startswith("memory: the update's activations, about ")
    assert "micro-batches of 2 rows of up to" in small
    _, rows, _ = micro_batch_activations(model, batch, 4)
    assert rows == min(4, len(batch))
    _, rows, _ = micro_batch_activations(model, batch, 4, max_tokens=1)
    assert rows == 1  # a micro-batch's token bound leaves one row
    long_first = [[1] * 10**6, *batch.attention_mask[1:]]  # one row of a million tokens
    big = type(batch)(**{**batch.__dict__, "attention_mask": long_first})
    warning = check_activations(model, big, 10**9, checkpointing=False)
    assert warning.startswith("warning: memory: the update's activations, about ")
    assert "set update.micro_batch_size to 1" in warning
    assert "or update.gradient_checkpointing=True" in warning
    sft = check_activations(model, big, 10**9, what="SFT")
    assert "memory: SFT's activations" in sft and "set SFT(micro_batch_size=...) to 1" in sft
    assert "checkpointing" not in sft


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK),
    reason="resetting VmHWM needs Linux's /proc/self/clear_refs, writable (not on macOS/Windows)",
)
def test_a_runs_peak_memory_starts_from_what_the_process_holds_not_an_earlier_peak() -> None:
    from voltrl.algorithms.local.memory import peak_gib, reset_peak

    reset_peak("cpu")
    before = peak_gib("cpu")
    block = bytearray(512 * 2**20)  # 512 MiB, touched: an earlier run's peak
    del block
    assert before is not None and peak_gib("cpu") >= before + 0.45
    reset_peak("cpu")
    assert peak_gib("cpu") < before + 0.25
