"""Policy-update throughput: trajectory vs transition mode, and LocalRL vs TRL's GRPOTrainer.

Synthetic 4-turn agent rollouts (each turn's prompt is the previous prompt + response + a tool
result) go through ``voltrl.trajectory.build_trajectory`` in both modes and are collated into
one batch per mode. Both batches hold the same generated tokens; transition mode re-feeds the
growing history once per turn, trajectory mode feeds each rollout once with the tool results
as mask-0 context. Each configuration trains a fresh copy of the same tiny random Qwen2 for
``--repeats`` timed steps after one warm-up step, configurations taking turns. The table
shows the median and the fastest step (wall clock); trained tokens/s and the ratios use the
fastest step, which other load on a shared machine disturbs least.

When ``trl`` is installed, TRL's ``GRPOTrainer`` runs its own ``training_step`` (loss
``dapo``: a token mean over the batch, like LocalRL's ``token-mean``; the same sampling
logprobs as old logprobs, the same advantages; generation skipped) plus gradient clipping and
its AdamW step, on the same model and batches, whole batch in one forward as TRL does, in
float32 without gradient checkpointing (TRL's defaults, bf16 autocast and checkpointing, are
turned off so that both compute the same thing). Every configuration starts from the same
weights and takes the same number of steps on the same batch, so equal ``last loss`` values
for one batch cross-check LocalRL's maths (and its micro-batch invariance) against TRL's.

    .venv/bin/python benchmarks/update_bench.py [--rollouts 16] [--group 4] [--turns 4]
        [--prompt 128] [--repeats 5] [--micro-batch 8] [--hidden 128] [--layers 4]
        [--threads N] [--no-trl]

On a machine shared with other busy processes, use ``--threads 1``: with more torch threads
than free cores, every parallel kernel waits for a descheduled thread and steps get tens of
times slower, which swamps what is measured here.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import random
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

from voltrl.algorithms.local.loss import grpo_advantages
from voltrl.algorithms.local.update import PolicyTrainer, PolicyUpdateConfig
from voltrl.trajectory import TrainingBatch, TrajectoryConfig, build_trajectory, collate
from voltrl.types import LLMCall, Rollout, Task

VOCAB = 1024
LR = 1e-5


Step = Callable[[], tuple[float, float]]
"""One training step on a fixed batch; returns the tokens it fed to the model and the loss."""


@dataclass
class Result:
    """One measured configuration."""

    name: str
    batch: TrainingBatch
    step: Step
    seconds: list[float] = field(default_factory=list)
    tokens_forward: float = 0.0
    loss: float = 0.0

    @property
    def step_s(self) -> float:
        """Median wall-clock seconds per step."""
        return statistics.median(self.seconds)

    @property
    def best_s(self) -> float:
        """Fastest step: the least disturbed by other load on the machine."""
        return min(self.seconds)

    @property
    def trained_tokens(self) -> int:
        return sum(map(sum, self.batch.response_mask))

    @property
    def tokens_per_s(self) -> float:
        """Trained tokens per second of the fastest step."""
        return self.trained_tokens / self.best_s


def make_calls(rid: str, rng: random.Random, turns: int, prompt_len: int) -> list[LLMCall]:
    """One rollout's calls: a prompt, then per turn a response (with sampling logprobs) and a
    tool result that the next turn's prompt appends."""
    prompt = [rng.randrange(1, VOCAB) for _ in range(prompt_len)]
    calls = []
    for turn in range(turns):
        response = [rng.randrange(1, VOCAB) for _ in range(rng.randint(24, 40))]
        calls.append(
            LLMCall(
                rollout_id=rid,
                attempt_id=f"{rid}-at",
                sequence_id=turn,
                prompt_token_ids=prompt,
                response_token_ids=response,
                response_logprobs=[-rng.uniform(5.0, 8.0) for _ in response],
            )
        )
        tool_result = [rng.randrange(1, VOCAB) for _ in range(rng.randint(16, 32))]
        prompt = [*prompt, *response, *tool_result]
    return calls


def make_batches(
    rollouts: int, group: int, turns: int, prompt_len: int, seed: int
) -> dict[str, TrainingBatch]:
    """The same rollouts collated in transition and in trajectory mode."""
    rng = random.Random(seed)
    records = []
    for k in range(rollouts):
        rid = f"ro-{k}"
        rollout = Rollout(
            rollout_id=rid,
            task=Task(task_id=f"task-{k // group}", input={}),
            status="succeeded",
            reward=rng.random(),
            final_attempt_id=f"{rid}-at",
        )
        records.append((rollout, make_calls(rid, rng, turns, prompt_len)))
    out = {}
    for mode in ("trajectory", "transition"):
        config = TrajectoryConfig(mode=mode)  # type: ignore[arg-type]
        trajectories = [build_trajectory(r, calls, config=config) for r, calls in records]
        out[mode] = collate(trajectories, config)
    return out


def make_model(hidden: int, layers: int) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=4 * hidden,
        max_position_embeddings=4096,
        pad_token_id=0,
    )
    return transformers.Qwen2ForCausalLM(config)


def measure(results: list[Result], repeats: int) -> None:
    """One warm-up step per configuration, then ``repeats`` rounds that step each
    configuration once in turn, so a burst of load elsewhere on the machine hits them all
    alike."""
    for r in results:
        r.step()
    for _ in range(repeats):
        for r in results:
            start = time.perf_counter()
            r.tokens_forward, r.loss = r.step()
            r.seconds.append(time.perf_counter() - start)


def localrl(name: str, model: Any, batch: TrainingBatch, micro_batch: int) -> Result:
    """LocalRL's ``PolicyTrainer.step`` on a fresh copy of ``model``."""
    config = PolicyUpdateConfig(lr=LR, micro_batch_size=micro_batch)
    trainer = PolicyTrainer(copy.deepcopy(model), config)

    def step() -> tuple[float, float]:
        metrics = trainer.step(batch)
        return metrics["tokens_forward"], metrics["loss"]

    return Result(name, batch, step)


def trl_trainer(model: Any, rows: int, group: int, workdir: str) -> Any:
    """A GRPOTrainer on ``model`` whose input preparation (generation) is bypassed."""
    from datasets import Dataset
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from trl import GRPOConfig, GRPOTrainer

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), pad_token="<pad>"
    )
    args = GRPOConfig(
        output_dir=workdir,
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=1,
        num_generations=group,
        learning_rate=LR,
        adam_beta1=0.9,
        adam_beta2=0.999,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_dropout=True,
        bf16=False,  # TRL's default is bf16 autocast: compare at LocalRL's float32
        gradient_checkpointing=False,  # TRL's default is on; LocalRL's is off
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["t1"] * rows}),
        processing_class=tokenizer,
    )
    trainer._prepare_inputs = lambda inputs: inputs  # the batch is already scored
    trainer.current_gradient_accumulation_steps = 1  # set by `train()`, which we do not run
    trainer.create_optimizer()
    return trainer


def trl_inputs(batch: TrainingBatch) -> dict[str, Any]:
    """The batch in GRPOTrainer's format: mask-0 context tokens are its ``tool_mask``."""
    t = batch.to_torch()
    response_real = t["attention_mask"][:, batch.prompt_length :]
    return {
        "prompt_ids": t["prompt_ids"],
        "prompt_mask": t["prompt_mask"],
        "completion_ids": t["response_ids"],
        "completion_mask": response_real,
        "tool_mask": t["response_mask"],
        "old_per_token_logps": t["response_logprobs"],
        "advantages": grpo_advantages(t["rewards"], batch.group_ids),
        "num_items_in_batch": t["response_mask"].sum(),
    }


def trl(name: str, model: Any, batch: TrainingBatch, group: int, workdir: str) -> Result:
    """TRL's ``training_step``, clipping and optimizer step on a fresh copy of ``model``."""
    trainer = trl_trainer(copy.deepcopy(model), len(batch), group, workdir)
    inputs = trl_inputs(batch)

    def step() -> tuple[float, float]:
        loss = trainer.training_step(trainer.model, inputs, inputs["num_items_in_batch"])
        torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1.0)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return float(len(batch) * (batch.prompt_length + batch.response_length)), float(loss)

    return Result(name, batch, step)


def print_table(results: list[Result]) -> None:
    print(
        f"{'configuration':<42} {'rows':>4} {'trained':>7} {'fed':>6} {'median s':>8} "
        f"{'best s':>7} {'trained tok/s':>13} {'last loss':>10}"
    )
    for r in results:
        print(
            f"{r.name:<42} {len(r.batch):>4} {r.trained_tokens:>7} {r.tokens_forward:>6.0f} "
            f"{r.step_s:>8.3f} {r.best_s:>7.3f} {r.tokens_per_s:>13.0f} {r.loss:>10.5f}"
        )


def print_ratio(label: str, fast: Result, slow: Result) -> None:
    """``slow / fast``: the ratio of their fastest steps."""
    print(f"  {label:<62} {slow.best_s / fast.best_s:5.2f}x")


def main() -> None:
    """Parse flags, build the batches, run every configuration, print tables and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4, help="rollouts per task (GRPO group)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128, help="first prompt's tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=8, help="LocalRL rows per forward")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL comparison")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    batches = make_batches(args.rollouts, args.group, args.turns, args.prompt, seed=0)
    model = make_model(args.hidden, args.layers)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs; Qwen2 {params / 1e6:.2f}M "
        f"params (hidden {args.hidden}, {args.layers} layers, vocab {VOCAB}); "
        f"{args.rollouts} rollouts x {args.turns} turns; median of {args.repeats} steps\n"
    )
    traj, trans = batches["trajectory"], batches["transition"]
    mb = args.micro_batch
    modes = [
        localrl(f"LocalRL trajectory mode, micro-batch {mb}", model, traj, mb),
        localrl(f"LocalRL transition mode, micro-batch {mb}", model, trans, mb),
    ]
    measure(modes, args.repeats)
    print_table(modes)
    print("\ntrajectory / transition trained tokens/s (same run)")
    print_ratio("trajectory mode is faster by", modes[0], modes[1])

    if args.no_trl:
        return
    try:
        import trl as trl_package
    except ImportError:
        print("\ntrl is not installed: TRL comparison skipped")
        return
    print(
        f"\nLocalRL vs TRL {trl_package.__version__} GRPOTrainer "
        f"(whole batch in one forward in both, as TRL runs it)"
    )
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory(prefix="voltrl-trl-") as tmp:
        versus = []
        for mode, batch in (("trajectory", traj), ("transition", trans)):
            versus.append(
                localrl(f"LocalRL {mode} mode, one micro-batch", model, batch, len(batch))
            )
            versus.append(trl(f"TRL GRPOTrainer {mode} mode", model, batch, args.group, tmp))
        measure(versus, args.repeats)
    print_table(versus)
    print("\nTRL step time / LocalRL step time (same run; > 1: LocalRL is faster)")
    for ours, theirs in zip(versus[::2], versus[1::2], strict=True):
        print_ratio(ours.name, ours, theirs)
    print_ratio(f"{modes[1].name} (packed) vs TRL transition", modes[1], versus[3])


if __name__ == "__main__":
    main()
