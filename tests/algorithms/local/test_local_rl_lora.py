"""LocalRL with LoRA end to end on a tiny model: merged weights served, checkpoints, resume and
the final model (merged for ``transformers``, the adapter for ``peft``)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from local_rl_setup import make_algorithm
from peft import PeftModel
from rl_agents import ROWS, two_turn_agent
from transformers import AutoModelForCausalLM

import voltrl as vl
from voltrl.algorithms.local.update import PolicyUpdateConfig
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.store.sql import SQLStore
from voltrl.trajectory import TrajectoryConfig
from voltrl.types import LLMCall

# An entropy bonus gives every row a gradient whatever the rewards (a random tiny model rarely
# earns one), so each update moves the adapters.
LORA = PolicyUpdateConfig(
    lr=1e-2, use_lora=True, lora_r=4, lora_alpha=8, entropy_coef=0.01, micro_batch_size=4
)
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def fit(tmp_path: Path, **overrides: Any) -> tuple[vl.LocalRL, vl.RunResult]:
    algo = make_algorithm(update=LORA, **overrides)
    trainer = vl.Trainer(
        algo, n_runners=1, inline=True, run_dir=tmp_path, name="lora", progress=False
    )
    return algo, trainer.fit(two_turn_agent, ROWS)


def updates(result: vl.RunResult) -> list[int]:
    return [m["step"] for m in result.metrics if "update/loss" in m]


async def calls_of(path: Path, rollouts: list[vl.Rollout]) -> list[LLMCall]:
    store = SQLStore(path)
    try:
        return [c for r in rollouts for c in await store.get_llm_calls(r.rollout_id)]
    finally:
        await store.close()


def teacher_forced(model: Any, prompt: list[int], ids: list[int]) -> list[float]:
    """Log-probabilities (temperature 1) of ``ids`` after ``prompt``, in one forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    return [lps[len(prompt) - 1 + k, t].item() for k, t in enumerate(ids)]


@pytest.mark.slow
def test_local_rl_with_lora_serves_merged_weights_checkpoints_resumes_and_saves(tmp_path: Path):
    untrained = build_tiny_model(build_tiny_tokenizer(), seed=0)  # the model LocalRL starts from
    initial = untrained.state_dict()
    algo, result = fit(tmp_path, schedule={"steps": 2})
    assert updates(result) == [1, 2] and result.by_mode["train"].failed == 0
    assert algo._engine is not None and algo._policies[None] is not None
    assert algo._engine.weights_version == 2
    # the engine serves a plain model with the adapters merged in
    served = algo._engine.model.state_dict()
    assert served.keys() == initial.keys()
    for name, weight in algo._policies[None].merged_state_dict().items():
        assert torch.equal(served[name], weight), name
    assert not torch.equal(served[Q_PROJ], initial[Q_PROJ])
    run = tmp_path / "lora"
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_00000001", "step_00000002"]

    # final/: the merged model for transformers, final/adapter/ for peft
    merged = AutoModelForCausalLM.from_pretrained(run / "final").eval()
    for name, weight in merged.state_dict().items():
        torch.testing.assert_close(weight, served[name], rtol=0, atol=0, msg=name)
    base = build_tiny_model(build_tiny_tokenizer(), seed=0)
    adapted = PeftModel.from_pretrained(base, run / "final" / "adapter").merge_and_unload()
    for name, weight in adapted.state_dict().items():
        torch.testing.assert_close(weight, served[name], rtol=1e-5, atol=1e-6, msg=name)

    # the same run resumed: step 3 samples from the adapters checkpointed at step 2, which
    # final/ holds merged
    before = {r.rollout_id for r in result.rollouts}
    resumed, result = fit(tmp_path, schedule={"steps": 3}, checkpoints={"resume": True})
    assert updates(result) == [3]
    assert (run / "checkpoints" / "step_00000003").is_dir()
    assert before < {r.rollout_id for r in result.rollouts}  # the result is the whole run's
    train = [r for r in result.rollouts if r.mode == "train" and r.rollout_id not in before]
    calls = asyncio.run(calls_of(run / "store.sqlite", train))
    assert len(calls) == 8
    sampled, from_merged, from_untrained = [], [], []
    for call in calls:
        assert call.prompt_token_ids is not None and call.response_token_ids is not None
        assert call.response_logprobs is not None
        ids = call.prompt_token_ids, call.response_token_ids
        sampled += call.response_logprobs
        from_merged += teacher_forced(merged, *ids)
        from_untrained += teacher_forced(untrained, *ids)
    # every token as the merged model scores it; the untrained one scores them apart (by ~0.1
    # a token, though a single token, say an end of text, may move by less than 1e-4)
    assert sampled == pytest.approx(from_merged, abs=1e-4)
    assert sampled != pytest.approx(from_untrained, abs=1e-2)
    assert resumed._engine is not None and resumed._engine.weights_version == 1


def test_a_lora_run_from_a_model_directory_prints_no_transformers_bars_or_peft_warnings(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
):
    """Loading the model, wrapping it with peft and saving the final model print nothing of
    transformers' or peft's own (progress bars, a deprecation warning): the run's console is
    VoltRL's. The bars are on again afterwards for the user's own loads."""
    import warnings

    from transformers.utils import logging as hf_logging

    tok = build_tiny_tokenizer()
    build_tiny_model(tok, seed=0).save_pretrained(tmp_path / "start")
    tok.save_pretrained(tmp_path / "start")
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        algo = vl.LocalRL(
            str(tmp_path / "start"),
            schedule={"steps": 1, "tasks_per_step": 2, "group_size": 2}, update=LORA,
            sampling={"temperature": 1.0, "max_tokens": 6},
            trajectory=TrajectoryConfig(mode="trajectory"),
        )  # fmt: skip
        trainer = vl.Trainer(algo, n_runners=1, inline=True, run_dir=tmp_path, progress=False)
        result = trainer.fit(two_turn_agent, ROWS)
    assert updates(result) == [1] and (result.run_dir / "final" / "adapter").is_dir()
    out = capfd.readouterr()
    for noise in ("Writing model shards", "Loading weights", "is_gradient_checkpointing"):
        assert noise not in out.out + out.err, noise
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    assert hf_logging.is_progress_bar_enabled()
