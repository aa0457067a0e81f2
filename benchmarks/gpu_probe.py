"""One script to run on a GPU machine (and, with small shapes, on a CPU: ``make test`` runs it
so): what LocalRL does with the device, in three parts, each printed as it finishes.

1. **Decode**: our engine's generated tokens/s against Hugging Face ``generate`` with a static
   batch of the same size, at concurrency 1, 16 and 64, on a Qwen2 shape of about 0.5B
   parameters in bfloat16 (random weights: speed does not depend on them).
2. **Update**: one PolicyTrainer step on rows of 1,024 tokens, in float32 and bfloat16, with
   and without gradient checkpointing, in micro-batches of 4 rows and of the whole batch, and
   compiled: seconds, model TFLOP/s (6 x parameters x tokens, plus a forward's 2 x when
   checkpointing recomputes it) and peak memory.
3. **Demo steps**: the calculator sample's LocalRL run with the tiny model (as ``make demo``
   trains it, no warm-up): each step's rollout and update seconds, from ``metrics.jsonl``.

    python benchmarks/gpu_probe.py                   # on a GPU: about 5 minutes on one H100
    python benchmarks/gpu_probe.py --small           # any machine: tiny shapes, seconds

It needs torch, transformers and pydantic for parts 1 and 2, and voltrl's other dependencies
for part 3 (fastapi, uvicorn, aiohttp, openai...: a GPU machine without them skips part 3 and
says so). voltrl itself is imported from this repository's tree when it is not installed.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]


def voltrl_from_the_tree() -> None:
    """Make ``voltrl`` importable from this repository's ``core/`` when it is not installed (a
    GPU machine gets the tree, not an install): the whole package when its dependencies are
    there, else a bare one whose modules load on import (parts 1 and 2 need only pydantic
    besides torch and transformers; part 3 then says what is missing)."""
    import importlib.util
    import types

    if importlib.util.find_spec("voltrl") is not None:
        return
    core = ROOT / "core"
    spec = importlib.util.spec_from_file_location(
        "voltrl", core / "__init__.py", submodule_search_locations=[str(core)]
    )
    assert spec is not None and spec.loader is not None
    sys.modules["voltrl"] = module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError:
        for name in [n for n in sys.modules if n == "voltrl" or n.startswith("voltrl.")]:
            del sys.modules[name]
        package = types.ModuleType("voltrl")
        package.__path__ = [str(core)]
        sys.modules["voltrl"] = package


SHAPES = {
    "0.5B": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True,
             "vocab_size": 151936},
    "small": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256},
}  # fmt: skip


def qwen2(shape: str, dtype: torch.dtype, device: str) -> Any:
    """A Qwen2 model of ``shape`` with random weights."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(pad_token_id=0, **SHAPES[shape])
    with torch.device(device):  # built where it runs: no CPU copy of a large model first
        model = transformers.Qwen2ForCausalLM(config)
    return model.to(dtype=dtype).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 1024**3
    return None


# ---- 1. decode -------------------------------------------------------------------------------
async def engine_rate(model: Any, concurrency: int, prompt: int, tokens: int) -> float:
    """Generated tokens/s of our engine with ``concurrency`` requests at once."""
    from voltrl.models.tiny import build_tiny_tokenizer
    from voltrl.serving.engine import Engine, SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(prompt)] for _ in range(concurrency)]
    with Engine(model, build_tiny_tokenizer(), max_batch_size=max(64, concurrency)) as engine:
        await engine.generate(prompts[0], SamplingParams(max_tokens=2, ignore_eos=True))
        start = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        elapsed = time.perf_counter() - start
    return sum(len(o.choices[0].token_ids) for o in outs) / elapsed


def hf_rate(model: Any, batch: int, prompt: int, tokens: int, device: str) -> float:
    """Generated tokens/s of ``model.generate`` on a static batch of ``batch`` prompts."""
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device=device)
    kwargs = {"do_sample": True, "top_k": 0, "pad_token_id": 0}
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)
        sync(device)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
        sync(device)
    return batch * tokens / (time.perf_counter() - start)


def hf_graph_rate(model: Any, prompt: int, tokens: int, device: str) -> tuple[float, float]:
    """Generated tokens/s of ``model.generate`` on one prompt with a static KV cache, which
    transformers compiles (``torch.compile(mode="reduce-overhead")``: CUDA graphs) on a GPU;
    and the seconds the first call took (the compilation)."""
    ids = torch.randint(1, model.config.vocab_size, (1, prompt), device=device)
    kwargs = {"do_sample": True, "top_k": 0, "pad_token_id": 0, "cache_implementation": "static"}
    with torch.inference_mode():
        start = time.perf_counter()
        for _ in range(2):  # the first call compiles; the second replays (a graph per shape)
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
        sync(device)
        compiled = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
        sync(device)
    return tokens / (time.perf_counter() - start), compiled


def decode(shape: str, device: str, dtype: torch.dtype, tokens: int) -> None:
    model = qwen2(shape, dtype, device)
    print(f"\n1. decode: {shape} Qwen2 shape, {str(dtype)[6:]}, {tokens} tokens per request")
    print("| concurrency | engine tok/s | HF generate (static batch) tok/s | engine / HF |")
    print("|---|---|---|---|")
    for concurrency in (1, 16, 64):
        ours = asyncio.run(engine_rate(model, concurrency, 64, tokens))
        theirs = hf_rate(model, concurrency, 64, tokens, device)
        print(f"| {concurrency} | {ours:,.0f} | {theirs:,.0f} | {ours / theirs:.2f}x |", flush=True)
    if device.startswith("cuda"):  # what CUDA graphs make of concurrency 1 (item 5's question)
        rate, compiled = hf_graph_rate(model, 64, tokens, device)
        print(
            f"| 1, HF static cache compiled (CUDA graphs) | - | {rate:,.0f} | - |\n"
            f"(its compilation and first two calls: {compiled:.0f} s)",
            flush=True,
        )


# ---- 2. update -------------------------------------------------------------------------------
UPDATE_SETTINGS = [  # (dtype, checkpointing, micro-batch size, compiled)
    (torch.float32, False, 4, False),
    (torch.float32, True, 4, False),
    (torch.bfloat16, False, 4, False),
    (torch.bfloat16, True, 4, False),
    (torch.bfloat16, False, 16, False),
    (torch.bfloat16, True, 16, False),
    (torch.bfloat16, False, 16, True),
]
"""Part 2's rows: the four of dtype x checkpointing at LocalRL's default micro-batch size,
then bfloat16 with the whole batch in one micro-batch (fewer kernel launches per token), and
that with the model compiled (``torch.compile``: fused elementwise kernels)."""


def update(shape: str, device: str, rows: int, length: int) -> None:
    from voltrl.algorithms.local.update import PolicyTrainer, PolicyUpdateConfig
    from voltrl.trajectory import collate
    from voltrl.types import Trajectory, Transition

    rng = random.Random(0)
    prompt = length // 4
    vocab = SHAPES[shape]["vocab_size"]
    trajectories = [
        Trajectory(
            rollout_id=f"r{i}",
            task_id=f"t{i // 4}",
            transitions=[
                Transition(
                    prompt_token_ids=[rng.randrange(1, vocab) for _ in range(prompt)],
                    response_token_ids=[rng.randrange(1, vocab) for _ in range(length - prompt)],
                    reward=float(i % 2),
                )
            ],
        )
        for i in range(rows)
    ]
    batch = collate(trajectories)
    print(f"\n2. update: {shape} Qwen2 shape, {rows} rows of {length} tokens")
    print("| dtype | checkpointing | micro-batch | compiled | seconds | model TFLOP/s | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for dtype, checkpointing, micro, compiled in UPDATE_SETTINGS:
        if compiled and not device.startswith("cuda"):
            continue  # inductor's CPU compilation: tens of seconds for nothing a GPU needs
        model = qwen2(shape, dtype, device).train()
        params = sum(p.numel() for p in model.parameters())
        config = PolicyUpdateConfig(
            lr=1e-6, micro_batch_size=min(micro, rows), gradient_checkpointing=checkpointing
        )
        trainer = PolicyTrainer(model, config)
        if compiled:
            model.compile()
        trainer.step(copy.deepcopy(batch))  # warm-up (allocator, kernels, compilation)
        sync(device)
        peak_reset(device)
        start = time.perf_counter()
        trainer.step(copy.deepcopy(batch))
        sync(device)
        seconds = time.perf_counter() - start
        flops = (8 if checkpointing else 6) * params * rows * length
        peak = peak_gib(device)
        shown = "-" if peak is None else f"{peak:.1f}"
        print(
            f"| {str(dtype)[6:]} | {checkpointing} | {min(micro, rows)} | {compiled} | "
            f"{seconds:.2f} | {flops / seconds / 1e12:.3g} | {shown} |",
            flush=True,
        )
        del trainer, model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


# ---- 3. the demo's steps ---------------------------------------------------------------------
def demo_steps(steps: int, tasks_per_step: int, group_size: int) -> None:
    print(f"\n3. demo steps: the calculator agent, tiny model, {steps} LocalRL steps")
    try:
        import openai  # noqa: F401

        import voltrl as vl

        vl.LocalRL  # noqa: B018  (a bare package, without the framework's dependencies)
    except (ModuleNotFoundError, AttributeError) as exc:
        missing = getattr(exc, "name", None) or "voltrl's dependencies"
        print(f"skipped: {missing} not installed here (carry voltrl's dependencies and openai)")
        return
    sys.path.insert(0, str(ROOT / "samples" / "calculator"))
    from agent import calculator_agent
    from data import make_tasks

    algo = vl.LocalRL(
        "tiny",
        schedule={"steps": steps, "tasks_per_step": tasks_per_step, "group_size": group_size},
        sampling={"temperature": 1.0, "max_tokens": 48},
        trajectory={"mode": "trajectory"},
    )
    with tempfile.TemporaryDirectory() as out:
        trainer = vl.Trainer(algo, run_dir=out, name="probe", max_concurrency=64, progress=False)
        result = trainer.fit(calculator_agent, make_tasks(200, seed=0))
        print("| step | rollouts | rollout s | update s |")
        print("|---|---|---|---|")
        for m in result.metrics:
            if "rollout_s" in m:
                count = m.get("train/rollouts", "-")
                print(f"| {m['step']} | {count} | {m['rollout_s']:.2f} | {m['update_s']:.2f} |")
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from step_timeline import table, timeline

        run = Path(result.run_dir)
        steps = asyncio.run(timeline(str(run / "store.sqlite"), run / "metrics.jsonl"))
        print("\nthe steps' timeline (seconds from each step's tasks being queued):")
        print(table(steps), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU, the tests)")
    parser.add_argument("--demo-steps", type=int, default=10, help="LocalRL steps of part 3")
    parser.add_argument("--parts", default="1,2,3", help="which parts to run")
    args = parser.parse_args(argv)
    voltrl_from_the_tree()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"gpu_probe: {name}; torch {torch.__version__}, transformers {transformers.__version__}")
    shape = "small" if args.small or device == "cpu" else "0.5B"
    parts = set(args.parts.split(","))
    if "1" in parts:
        bf16 = device == "cuda" and torch.cuda.is_bf16_supported()
        decode(shape, device, torch.bfloat16 if bf16 else torch.float32, 8 if args.small else 128)
    if "2" in parts:
        update(shape, device, rows=4 if args.small else 16, length=64 if args.small else 1024)
    if "3" in parts:
        small = args.small
        demo_steps(args.demo_steps, 2 if small else 8, 2 if small else 8)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
