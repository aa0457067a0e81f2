"""Tiny models and training batches that the policy-update, precision, memory, threads and
LoRA tests train on."""

from __future__ import annotations

from typing import Any

import torch
import transformers

from voltrl.algorithms.local.loss import (
    token_logprobs,
)
from voltrl.trajectory import TrainingBatch, TrajectoryConfig, build_trajectory, collate
from voltrl.types import LLMCall, Rollout, Task, Trajectory, Transition


def tiny_model(seed: int = 0) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    )
    return transformers.Qwen2ForCausalLM(config)


def varied_batch() -> TrainingBatch:
    """Two tasks of three rollouts, prompts and responses of different lengths, one rollout
    with two rows, so padding, groups and rollouts all matter."""
    trajectories = [
        Trajectory(rollout_id="a1", task_id="a", transitions=[row([1, 2, 3], [10, 11, 12], 1.0)]),
        Trajectory(rollout_id="a2", task_id="a", transitions=[row([1, 2, 3], [13, 14], 0.0)]),
        Trajectory(
            rollout_id="a3",
            task_id="a",
            transitions=[row([1, 2, 3], [15], 0.5), row([1, 2, 3, 15, 7], [16, 17, 18, 19], 0.5)],
        ),
        Trajectory(rollout_id="b1", task_id="b", transitions=[row([4, 5], [20, 21, 22, 23], 0.0)]),
        Trajectory(rollout_id="b2", task_id="b", transitions=[row([4, 5, 6, 7, 8, 9], [24], 1.0)]),
        Trajectory(rollout_id="b3", task_id="b", transitions=[row([4], [25, 26], 2.0)]),
    ]
    return collate(trajectories)


def agent_batch(mode: str) -> TrainingBatch:
    config = TrajectoryConfig(mode=mode)  # type: ignore[arg-type]
    trajectories = [
        build_trajectory(rollout(f"r{k}", "t", float(k)), agent_calls(f"r{k}", k), config=config)
        for k in range(3)
    ]
    return collate(trajectories, config)


def set_sampling_logprobs(model: torch.nn.Module, batch: TrainingBatch) -> None:
    """Record the model's own logprobs as the sampling logprobs, as the engine would."""
    t = batch.to_torch()
    with torch.no_grad():
        lp, _ = token_logprobs(
            model,
            t["input_ids"],
            t["attention_mask"],
            t["position_ids"],
            batch.response_length,
            with_entropy=False,
        )
    batch.response_logprobs = (lp * t["response_mask"]).tolist()


def sampled_batch(model: Any, tokenizer: Any) -> Any:
    """Two groups of two rows whose old logprobs are ``model``'s own (as if it sampled them)."""
    trajectories = []
    for i, reward in enumerate([1.0, 0.0, 0.5, 0.0]):
        prompt, response = [5 + i, 6, 7], [8 + i, 9, 10 + i]
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])
        row = Transition(
            prompt_token_ids=prompt,
            response_token_ids=response,
            response_logprobs=logprobs.squeeze(-1).tolist(),
            reward=reward,
        )
        trajectories.append(
            Trajectory(rollout_id=f"r{i}", task_id=f"t{i // 2}", transitions=[row], reward=reward)
        )
    return collate(trajectories, TrajectoryConfig(pad_token_id=tokenizer.pad_token_id))


def agent_calls(rid: str, seed: int) -> list[LLMCall]:
    """A 3-turn agent: each prompt extends the previous prompt + response with a tool
    result, so trajectory mode merges them into one row with mask-0 tool tokens."""
    calls, prompt = [], [1, 2, 3]
    for turn in range(3):
        response = [30 + seed + turn, 40 + turn]
        calls.append(
            LLMCall(
                rollout_id=rid,
                attempt_id=f"{rid}-at",
                sequence_id=turn,
                prompt_token_ids=prompt,
                response_token_ids=response,
            )
        )
        prompt = [*prompt, *response, 90 + seed, 91 + turn]
    return calls


def row(prompt: list[int], response: list[int], reward: float) -> Transition:
    return Transition(prompt_token_ids=prompt, response_token_ids=response, reward=reward)


def rollout(rid: str, task_id: str, reward: float) -> Rollout:
    return Rollout(
        rollout_id=rid,
        task=Task(task_id=task_id, input={}),
        status="succeeded",
        reward=reward,
        final_attempt_id=f"{rid}-at",
    )
