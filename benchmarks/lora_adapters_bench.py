"""What per-role LoRA adapters cost: serving them in one batch, and training N of them.

**Decode.** One decode step (a token for every running sequence, with a KV cache of a
``--prompt``-token prompt) for ``--rows`` sequences spread evenly over N adapters, three ways:

- ``mixed``: one forward pass over every row, each row with its own adapter (peft's
  mixed-adapter batch: the engine's way);
- ``per adapter``: one forward pass per adapter over its rows (the adapter active, unmerged);
- ``merged copies``: one forward pass per adapter over its rows, each on its own copy of the
  model with that adapter merged in (no LoRA cost per step, N copies in memory).

The base model decoding every row in one pass is the floor. Times are medians over
``--repeats``, configurations taking turns; the ratios are per adapter and merged copies over
mixed (above 1: mixed is faster).

**Training.** N roles trained as N LoRA adapters on one base model (LocalRL's ``lora_adapters=``)
against N full copies of the model, each trained on its own rows (the same ``--batch`` rows
split evenly): the memory the weights and optimizer state hold between steps (counted from
the tensors themselves, with the engine's serving copy: the base and N adapters, or N models)
and the time of one update of every role. N = 1, 2, 4.

**Swap.** How long the engine takes to load one adapter's new weights (LocalRL's pause
between steps), against loading a full model's.

    .venv/bin/python benchmarks/lora_adapters_bench.py [--hidden 256] [--layers 4] [--rows 32]
    make bench-lora-adapters
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from voltrl.algorithms.local.update import PolicyTrainer, PolicyUpdateConfig
from voltrl.models.threads import decide_threads, use_threads
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.trajectory import TrainingBatch, collate
from voltrl.types import Trajectory, Transition

LORA = PolicyUpdateConfig(use_lora=True, lora_r=16, lora_alpha=32, lr=1e-4, micro_batch_size=8)
FULL = PolicyUpdateConfig(lr=1e-5, micro_batch_size=8)


def names(n: int) -> list[str]:
    return [f"role{i}" for i in range(n)]


def with_adapters(base: Any, n: int) -> tuple[Any, list[PolicyTrainer]]:
    """``base`` (copied) with ``n`` adapters whose weights are not the identity, and their
    trainers."""
    model = copy.deepcopy(base)
    trainers = []
    for name in names(n):
        trainers.append(PolicyTrainer(model, LORA, adapter=name))
        model = trainers[-1].model
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "lora_B" in key:
                p.normal_(0, 0.02)
    return model, trainers


# ---- decode ---------------------------------------------------------------------------------


def decode_step_s(model: Any, rows: int, prompt: int, steps: int, **kw: Any) -> float:
    """Seconds per decode step of ``rows`` sequences after a ``prompt``-token prefill."""
    ids = torch.randint(10, 400, (rows, prompt))
    cache = DynamicCache()
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **kw)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(
                input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1, **kw
            )
            token = out.logits[:, -1].argmax(-1, keepdim=True)
    return (time.perf_counter() - start) / steps


def decode(base: Any, args: argparse.Namespace) -> list[str]:
    lines = [
        f"decode step, {args.rows} sequences, {args.prompt}-token prompts "
        f"(ms, median of {args.repeats}):",
        f"{'adapters':>9} {'base':>8} {'mixed':>8} {'per adapter':>12} {'merged copies':>14}"
        f" {'per adapter/mixed':>18} {'copies/mixed':>13}",
    ]
    for n in (2, 4):
        model, _ = with_adapters(base, n)
        model.eval()
        merged = []
        for name in names(n):
            model.set_adapter(name)
            merged.append(copy.deepcopy(model).merge_and_unload().eval())
        share = args.rows // n
        spread = [names(n)[i % n] for i in range(args.rows)]

        def per_adapter(model: Any = model, n: int = n, share: int = share) -> float:
            total = 0.0
            for name in names(n):
                model.set_adapter(name)
                total += decode_step_s(model, share, args.prompt, args.steps)
            return total

        runs: dict[str, Callable[[], float]] = {
            "base": lambda: decode_step_s(base, args.rows, args.prompt, args.steps),
            "mixed": lambda model=model, spread=spread: decode_step_s(
                model, args.rows, args.prompt, args.steps, adapter_names=spread
            ),
            "per adapter": per_adapter,
            "merged copies": lambda merged=merged, share=share: sum(
                decode_step_s(m, share, args.prompt, args.steps) for m in merged
            ),
        }
        times = timed(runs, args.repeats)
        mixed = times["mixed"]
        lines.append(
            f"{n:>9} {times['base'] * 1e3:>8.2f} {mixed * 1e3:>8.2f} "
            f"{times['per adapter'] * 1e3:>12.2f} {times['merged copies'] * 1e3:>14.2f} "
            f"{times['per adapter'] / mixed:>17.2f}x {times['merged copies'] / mixed:>12.2f}x"
        )
    return lines


def swaps(base: Any, args: argparse.Namespace) -> list[str]:
    """How long the engine takes to load one adapter's new weights, against a full model's."""
    from voltrl.serving.engine import Engine

    tok = build_tiny_tokenizer()
    model, trainers = with_adapters(base, 2)
    engine = Engine(copy.deepcopy(model).requires_grad_(False), tok, lora_adapters=True)
    plain = Engine(copy.deepcopy(base), tok)
    adapter, full = trainers[0].adapter_state_dict(), copy.deepcopy(base.state_dict())
    times = timed(
        {
            "adapter": lambda: _seconds(lambda: engine.update_weights(adapter, adapter="role0")),
            "full": lambda: _seconds(lambda: plain.update_weights(full)),
        },
        args.repeats,
    )
    return [
        f"weights swap in the engine: one adapter {times['adapter'] * 1e3:.2f} ms, the full "
        f"model {times['full'] * 1e3:.2f} ms ({times['full'] / times['adapter']:.1f}x)"
    ]


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Median of each, the configurations taking turns (order alternating each repeat)."""
    out: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(repeats + 1):
        order = list(runs) if r % 2 else list(reversed(runs))
        for key in order:
            value = runs[key]()
            if r:  # the first round warms up
                out[key].append(value)
    return {k: statistics.median(v) for k, v in out.items()}


# ---- training -------------------------------------------------------------------------------


def synthetic_batch(rows: int, prompt: int, response: int, seed: int) -> TrainingBatch:
    """``rows`` rows in groups of 4 with varied rewards (every row has an advantage)."""
    rng = random.Random(seed)
    trajectories = [
        Trajectory(
            rollout_id=f"r{i}",
            task_id=f"t{i // 4}",
            reward=float(i % 4) / 3,
            transitions=[
                Transition(
                    prompt_token_ids=[rng.randrange(10, 400) for _ in range(prompt)],
                    response_token_ids=[rng.randrange(10, 400) for _ in range(response)],
                    response_logprobs=[-6.0] * response,
                )
            ],
        )
        for i in range(rows)
    ]
    return collate(trajectories)


def held_bytes(models: list[Any], trainers: list[PolicyTrainer]) -> int:
    """Bytes of the distinct tensors the weights and optimizer states hold."""
    seen: dict[int, int] = {}
    tensors = [p for m in models for p in m.parameters()]
    for t in trainers:
        for state in t.optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def train(base: Any, args: argparse.Namespace) -> list[str]:
    lines = [
        f"one update of every role, {args.batch} rows of {args.prompt}+{args.response} tokens "
        f"split evenly (median of {args.repeats}); memory: weights + optimizer state + the "
        "serving copy:",
        f"{'roles':>6} {'adapters MB':>12} {'full copies MB':>15} {'memory ratio':>13}"
        f" {'adapters s':>11} {'full copies s':>14} {'time ratio':>11}",
    ]
    batch = synthetic_batch(args.batch, args.prompt, args.response, seed=0)
    for n in (1, 2, 4):
        size = len(batch) // n  # whole GRPO groups of 4 per role
        share = [batch.select(range(k * size, (k + 1) * size)) for k in range(n)]
        model, adapter_trainers = with_adapters(base, n)
        serving, _ = with_adapters(base, n)
        copies = [copy.deepcopy(base) for _ in range(n)]
        full_trainers = [PolicyTrainer(m, FULL) for m in copies]

        def update(trainers: list[PolicyTrainer], share: list[TrainingBatch] = share) -> float:
            start = time.perf_counter()
            for trainer, part in zip(trainers, share, strict=True):
                trainer.step(part)
            return time.perf_counter() - start

        times = timed(
            {
                "adapters": lambda t=adapter_trainers: update(t),
                "full": lambda t=full_trainers: update(t),
            },
            args.repeats,
        )
        mem_adapters = held_bytes([model, serving], adapter_trainers)
        mem_full = held_bytes([*copies, *(copy.deepcopy(base) for _ in range(n))], full_trainers)
        lines.append(
            f"{n:>6} {mem_adapters / 2**20:>12.1f} {mem_full / 2**20:>15.1f}"
            f" {mem_full / mem_adapters:>12.2f}x {times['adapters']:>11.2f}"
            f" {times['full']:>14.2f} {times['full'] / times['adapters']:>10.2f}x"
        )
        del model, serving, copies, adapter_trainers, full_trainers
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=32, help="sequences decoded together")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32, help="training rows per update")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    use_threads(decide_threads(args.threads), report=True)
    warnings.filterwarnings("ignore")  # peft's and transformers' deprecation notices
    torch.manual_seed(0)
    base = build_tiny_model(build_tiny_tokenizer(), hidden=args.hidden, layers=args.layers)
    params = sum(p.numel() for p in base.parameters())
    print(f"model: hidden {args.hidden}, {args.layers} layers, {params / 1e6:.1f}M parameters; "
          f"LoRA r={LORA.lora_r} on every linear layer")  # fmt: skip
    for line in [*decode(base, args), *swaps(base, args)]:
        print(line, flush=True)
    for line in train(base, args):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
