"""LocalRL engine throughput against plain ``model.generate``, measured in the same run.

For each concurrency ``c`` (1, 8, 32 by default), ``c`` closed-loop clients each send
``--rounds`` requests to the engine back to back (every request samples exactly
``--max-tokens`` tokens at temperature 1); the baseline generates the same kind of request with
``model.generate`` one at a time. Engine and baseline runs are interleaved, ``--repeats`` times,
and the medians are reported as generated tokens per wall-clock second and per CPU second of
this process (steadier on a shared machine), with their ratios::

    .venv/bin/python benchmarks/engine_bench.py [--hidden 64 --layers 2 --max-tokens 64]
    .venv/bin/python benchmarks/engine_bench.py --model smollm2-135m-instruct

``--model`` takes whatever ``LocalRL`` takes (a packaged model's name, fetched on first use, a
directory or a hub name) instead of a tiny model; its prompts are then an agent's (the
calculator sample's system prompt and tool schema, then a question, through the model's chat
template), and the engine is measured with its prefix cache and without (every prompt fed
whole), beside ``model.generate``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from voltrl.models.loading import load_model
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.serving.engine import Engine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "samples" / "calculator"))
from agent import CALCULATOR, SYSTEM  # the calculator sample's prompt


def prompts(tok: Any, count: int, agent: bool = False) -> list[list[int]]:
    """Arithmetic questions of a few different lengths, as token ids; with ``agent``, as an
    agent sends them: a system prompt and a tool schema, then the question, through the
    tokenizer's chat template (the calculator sample's prompt)."""
    texts = [
        f"Question: compute {i * 37 % 1000} + {i * 11 % 100}" + " + 1" * (i % 5) + "."
        for i in range(count)
    ]
    if not agent:
        return [tok.encode(t, add_special_tokens=False) for t in texts]
    return [
        list(
            tok.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": t}],
                tools=[CALCULATOR],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=True,
            )["input_ids"]
        )
        for t in texts
    ]


Rate = tuple[float, float]  # tokens per wall-clock second, per CPU second


def _rate(tokens: int, wall0: float, cpu0: float) -> Rate:
    return tokens / (time.perf_counter() - wall0), tokens / (time.process_time() - cpu0)


def baseline(model: Any, batch: list[list[int]], max_tokens: int) -> Rate:
    """Throughput of ``model.generate``, one request at a time."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for ids in batch:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=model.generation_config.pad_token_id,
            )
            assert out.shape[1] == len(ids) + max_tokens
    return _rate(len(batch) * max_tokens, wall0, cpu0)


async def engine_run(
    engine: Engine, batch: list[list[int]], concurrency: int, rounds: int, max_tokens: int
) -> Rate:
    """Throughput of ``concurrency`` closed-loop clients, ``rounds`` requests each."""
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)

    async def client(k: int) -> int:
        done = 0
        for r in range(rounds):
            out = await engine.generate(batch[(k * rounds + r) % len(batch)], params)
            done += len(out.choices[0].token_ids)
        return done

    wall0, cpu0 = time.perf_counter(), time.process_time()
    tokens = sum(await asyncio.gather(*(client(k) for k in range(concurrency))))
    assert tokens == concurrency * rounds * max_tokens
    return _rate(tokens, wall0, cpu0)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="requests per client")
    ap.add_argument("--baseline-requests", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--model", help="a model LocalRL can load, instead of a tiny one")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.model:
        model, tok = load_model(args.model, device="cpu")
        described = f"{args.model} ({type(model).__name__})"
    else:
        tok = build_tiny_tokenizer()
        model = build_tiny_model(tok, hidden=args.hidden, layers=args.layers)
        described = f"tiny Qwen2: hidden={args.hidden} layers={args.layers}"
    model.eval()
    batch = prompts(tok, 64, agent=bool(args.model))
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{described} params={params:,}; prompts {min(map(len, batch))}-"
        f"{max(map(len, batch))} tokens; torch threads={torch.get_num_threads()}; "
        f"cpus={os.cpu_count()}; load average={os.getloadavg()[0]:.2f}; "
        f"{args.max_tokens} tokens per request",
        flush=True,
    )
    size = max(args.concurrency)
    results: dict[int, dict[str, list[Rate]]] = {}
    with (
        Engine(model, tok, max_batch_size=size, seed=0) as engine,
        Engine(model, tok, max_batch_size=size, seed=0, prefix_cache_tokens=0) as whole,
    ):
        for e in (engine, whole):
            await engine_run(e, batch, 2, 1, 8)  # warm-up
        baseline(model, batch[:1], 8)
        for c in args.concurrency:
            runs: dict[str, list[Rate]] = {"engine": [], "whole": [], "generate": []}
            for _ in range(args.repeats):
                runs["generate"].append(
                    baseline(model, batch[: args.baseline_requests], args.max_tokens)
                )
                runs["engine"].append(
                    await engine_run(engine, batch, c, args.rounds, args.max_tokens)
                )
                runs["whole"].append(
                    await engine_run(whole, batch, c, args.rounds, args.max_tokens)
                )
            results[c] = runs
            print(f"concurrency {c}: done", flush=True)
        cached = engine.stats["prefix_cached_tokens"]
        fed = engine.stats["prefill_tokens"]

    cols = [
        "concurrency",
        "engine tok/s",
        "no prefix cache",
        "generate tok/s",
        "engine/generate",
        "engine/no cache",
        "engine/generate per CPU-s",
    ]
    print("\n" + " | ".join(cols))
    print("-+-".join("-" * len(c) for c in cols))
    for c, runs in results.items():
        wall = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
        cpu = {k: statistics.median(r[1] for r in v) for k, v in runs.items()}
        cells = [
            f"{c}",
            f"{wall['engine']:.0f}",
            f"{wall['whole']:.0f}",
            f"{wall['generate']:.0f}",
            f"{wall['engine'] / wall['generate']:.2f}x",
            f"{wall['engine'] / wall['whole']:.2f}x",
            f"{cpu['engine'] / cpu['generate']:.2f}x",
        ]
        print(" | ".join(cell.rjust(len(col)) for cell, col in zip(cells, cols, strict=True)))
    print(
        f"\nmedians of {args.repeats} interleaved repeats, tokens generated per wall-clock "
        "second; generate = model.generate, one request at a time; no prefix cache = the "
        f"engine feeding every prompt whole; all measured in the same run. The engine took "
        f"{cached:,} prompt tokens from its prefix cache and fed {fed:,}."
    )


if __name__ == "__main__":
    asyncio.run(main())
