"""LocalRL's memory estimate: its parts add up from the model's own tensors, its LoRA count is
what peft really adds, and a run that cannot fit its device is refused with what would fit."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from helpers import ROOT
from tiny_batches import tiny_model

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
    found = estimate(model, PolicyUpdateConfig(), max_batch_size=8, context_tokens=100)
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
        context_tokens=100,
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


def test_an_sft_warm_start_before_lora_is_the_peak_when_it_is_larger() -> None:
    model = tiny_model().to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    lora = PolicyUpdateConfig(use_lora=True)
    found = estimate(model, lora, max_batch_size=1, context_tokens=1, warm_start=True)
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
