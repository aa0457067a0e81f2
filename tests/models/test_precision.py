"""LocalRL's precision: a model in bfloat16 samples and trains consistently (the engine's
logprobs and the update's agree), its small updates survive (float32 master weights), its
checkpoints resume exactly, and LocalRL trains one end to end; all on this CPU."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_batches import set_sampling_logprobs, tiny_model, varied_batch

import voltrl as vl
from voltrl.algorithms.local.master_weights import MasterWeights
from voltrl.algorithms.local.update import PolicyTrainer, PolicyUpdateConfig
from voltrl.models.loading import load_model
from voltrl.models.precision import resolve_dtype
from voltrl.serving.engine import Engine, SamplingParams
from voltrl.trajectory import collate
from voltrl.types import Trajectory, Transition

LOGPROB_TOLERANCE = 0.02
"""Most a bfloat16 model's engine and update may disagree on a token's logprob. Both run the
same bfloat16 weights and take logprobs in float32, but the engine feeds a prompt once and
then a token at a time with a KV cache, the update the whole sequence at once: in bfloat16,
the different order of the sums moves a logprob (0.002 at most on this test's 48 tokens
here; in float32, about 1e-6). The bound leaves room for other CPUs' kernels."""


def test_auto_is_float32_on_a_cpu_and_other_names_are_refused() -> None:
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16"):
        resolve_dtype("fp8", "cpu")
    with pytest.raises(ValueError, match="dtype must be one of"):
        vl.LocalRL("tiny", compute={"dtype": "half"})
    with pytest.raises(ValueError, match="'float16' cannot train here"):
        vl.LocalRL("tiny", compute={"dtype": "float16"})
    model, _ = load_model("tiny", dtype="bfloat16", device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


async def test_a_bf16_models_engine_and_update_logprobs_agree() -> None:
    model, tok = load_model("tiny", dtype="bfloat16", device="cpu", seed=1)
    prompt = tok.encode("What is 7 * 6?", add_special_tokens=False)
    with Engine(copy.deepcopy(model), tok, seed=0) as engine:
        out = await engine.generate(prompt, SamplingParams(max_tokens=24, seed=3, n=2))
    rows = [
        Trajectory(
            rollout_id=f"r{i}",
            task_id="t",
            transitions=[
                Transition(
                    prompt_token_ids=prompt,
                    response_token_ids=c.token_ids,
                    response_logprobs=c.logprobs,
                    reward=float(i),
                )
            ],
        )
        for i, c in enumerate(out.choices)
    ]
    batch = collate(rows)
    engine_lps = [lp for row in batch.response_logprobs for lp in row]
    set_sampling_logprobs(model, batch)  # the update's own forward pass, as it recomputes
    update_lps = [lp for row in batch.response_logprobs for lp in row]
    gaps = [abs(a - b) for a, b in zip(engine_lps, update_lps, strict=True)]
    assert max(gaps) <= LOGPROB_TOLERANCE, max(gaps)


def test_master_weights_keep_updates_a_bf16_weight_cannot_hold() -> None:
    def trained(masters: bool) -> torch.Tensor:
        weight = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        kept = MasterWeights([weight]) if masters else None
        optimizer = torch.optim.SGD(kept.optimized if kept else [weight], lr=1e-3)
        for _ in range(20):  # each step is 1e-3, under bfloat16's 1/128 step at 1.0
            optimizer.zero_grad()
            weight.sum().backward()  # a gradient of 1 each; with masters, moved to theirs
            optimizer.step()
            if kept:
                kept.masters_to_params()
        return weight.detach().float()

    assert torch.equal(trained(masters=False), torch.ones(4))  # every step rounded away
    assert trained(masters=True).max() < 0.99  # 20 steps of 1e-3 kept, then rounded


def test_a_bf16_policy_trains_in_float32_masters_and_resumes_exactly(tmp_path: Path) -> None:
    config = PolicyUpdateConfig(lr=1e-3, mini_batches=2)
    batch = varied_batch()
    first = PolicyTrainer(tiny_model().to(torch.bfloat16), config)
    masters = list(first.masters.masters.values())
    assert masters and {m.dtype for m in masters} == {torch.float32}
    assert {p.dtype for p in first.optimizer.param_groups[0]["params"]} == {torch.float32}
    before = [p.detach().clone() for p in first.params]
    first.accumulate_gradients(batch)  # micro-batches accumulate in the float32 masters
    assert all(p.grad is None for p in first.params)
    assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in masters)
    first.optimizer.zero_grad(set_to_none=True)
    first.step(batch)
    assert any(not torch.equal(a, b) for a, b in zip(before, first.params, strict=True))
    for i, master in first.masters.masters.items():  # the model holds its masters, rounded
        assert torch.equal(first.params[i].detach(), master.detach().to(torch.bfloat16))
    first.save_checkpoint(tmp_path)
    expected = first.step(batch)

    resumed = PolicyTrainer(tiny_model().to(torch.bfloat16), config)
    resumed.load_checkpoint(tmp_path)
    got = resumed.step(batch)
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    for a, b in zip(first.masters.optimized, resumed.masters.optimized, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_lora_over_a_bf16_base_trains_float32_adapters() -> None:
    model = tiny_model().to(torch.bfloat16)
    trainer = PolicyTrainer(model, PolicyUpdateConfig(lr=1e-3, use_lora=True))
    assert {p.dtype for p in trainer.params} == {torch.float32}
    assert not trainer.masters.masters  # nothing to copy: the adapters are float32 already
    batch = varied_batch()
    set_sampling_logprobs(trainer.model, batch)
    assert trainer.step(batch)["grad_norm"] > 0


async def test_local_rl_trains_a_bf16_model_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    @vl.rollout
    async def replies(task: dict[str, Any], llm: vl.LLM) -> float:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key)
        reply = await client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=4
        )
        return len(reply.choices[0].message.content or "") / 10  # differs within a group

    algo = vl.LocalRL(
        "tiny",
        schedule={"steps": 1, "tasks_per_step": 2, "group_size": 2},
        compute={"dtype": "bfloat16"},
    )
    result = await vl.Trainer(
        algo, run_dir=tmp_path, name="bf16", inline=True, progress=True
    ).fit_async(replies, [{"q": "say a"}, {"q": "say b"}])
    assert "memory estimate: " in capsys.readouterr().out  # printed before training
    assert result.run.config["compute"]["dtype"] == "bfloat16"
    assert [m["step"] for m in result.metrics if "update/loss" in m] == [1]
    saved = torch.load(
        next((tmp_path / "bf16" / "checkpoints").glob("step_*")) / "masters.pt", weights_only=True
    )
    assert saved and {t.dtype for t in saved.values()} == {torch.float32}


@vl.rollout
async def replies(task: dict[str, Any], llm: vl.LLM) -> float:
    """One short reply; its reward differs within a group."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key)
    reply = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=4
    )
    return len(reply.choices[0].message.content or "") / 10


async def test_a_float32_run_resumed_in_bf16_takes_its_masters_from_the_float32_checkpoint(
    tmp_path: Path,
) -> None:
    """``dtype`` may change on resume: the bfloat16 model's float32 master weights are the
    float32 values the checkpoint holds, not the bfloat16 model's rounded copies of them."""
    rows = [{"q": "say a"}, {"q": "say b"}]

    def fit(dtype: str, steps: int) -> Any:
        algo = vl.LocalRL(
            "tiny",
            schedule={"steps": steps, "tasks_per_step": 2, "group_size": 2},
            compute={"dtype": dtype},
            checkpoints={"resume": True},
        )
        trainer = vl.Trainer(algo, run_dir=tmp_path, name="r", inline=True, progress=False)
        return algo, trainer.fit_async(replies, rows)

    _, run = fit("float32", 1)
    await run
    saved = torch.load(
        tmp_path / "r" / "checkpoints" / "step_00000001" / "model.pt", weights_only=True
    )
    resumed, run = fit("bfloat16", 1)  # nothing left to train: it loads the checkpoint
    await run
    policy = resumed._policies[None]
    names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert policy.masters.masters  # the bfloat16 model trains through float32 masters
    rounded = 0
    for i, master in policy.masters.masters.items():
        exact = saved[names[i]]
        assert torch.equal(master.detach(), exact), names[i]
        rounded += not torch.equal(exact.to(torch.bfloat16).float(), exact)
    assert rounded  # the rounded copies would have differed
