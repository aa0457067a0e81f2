"""The SmolLM2 recipes of the framework samples (AutoGen, Agent Framework + MCP, the Agents SDK
as a service), each shrunk to one RL step: the scripted teacher's rollouts recorded through
the real framework and gateway, re-tokenised with SmolLM2's chat template without a merge
failure (each framework sends the conversation back as the template rendered it), SFT of
every weight, a LoRA step, validation before and after, and the final model saved.
``benchmarks/learning.py <sample> --model smollm2-135m-instruct`` runs them whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from real_recipes import one_step_recipe

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("sample", ["autogen_calc", "calc_mcp", "agent_service"])
def test_the_samples_recipe_warms_up_trains_a_lora_adapter_and_saves_the_model(
    sample: str, model_dir: Path, tmp_path: Path
):
    row = one_step_recipe(sample, tmp_path)
    assert row["model"] == MODEL and row["sample"] == sample
    # 16 episodes, one row each: every call's prompt extends the previous call's prompt and
    # answer as SmolLM2's template renders them (tool calls and tool results included)
    assert row["sft_rows"] == 16 and row["sft_merge_failures"] == 0
    assert row["after_sft"] is not None and row["after_rl"] is not None
    final = Path(row["run_dir"]) / "final"  # the merged model, and the adapter beside it
    assert json.loads((final / "config.json").read_text())["architectures"]
    assert (final / "adapter" / "adapter_config.json").is_file()
