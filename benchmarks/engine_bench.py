"""LocalRL engine throughput against plain ``model.generate``, measured in the same run.

For each concurrency ``c`` (1, 8, 32 by default), ``c`` closed-loop clients each send
``--rounds`` requests to the engine back to back (every request samples exactly
``--max-tokens`` tokens at temperature 1); the baseline generates the same kind of request with
``model.generate`` one at a time. Engine and baseline runs are interleaved, ``--repeats`` times,
and the medians are reported as generated tokens per wall-clock second and per CPU second of
this process (steadier on a shared machine), with their ratios::

    .venv/bin/python benchmarks/engine_bench.py [--hidden 64 --layers 2 --max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

import torch

from voltrl.algorithms.local.engine import Engine, SamplingParams
from voltrl.algorithms.local.tiny import build_tiny_model, build_tiny_tokenizer


def prompts(tok: Any, count: int) -> list[list[int]]:
    """Arithmetic questions of a few different lengths, as token ids."""
    return [
        tok.encode(
            f"Question: compute {i * 37 % 1000} + {i * 11 % 100}" + " + 1" * (i % 5) + ".",
            add_special_tokens=False,
        )
        for i in range(count)
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
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden=args.hidden, layers=args.layers)
    batch = prompts(tok, 64)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"tiny Qwen2: hidden={args.hidden} layers={args.layers} params={params:,}; "
        f"torch threads={torch.get_num_threads()}; cpus={os.cpu_count()}; "
        f"load average={os.getloadavg()[0]:.2f}; {args.max_tokens} tokens per request"
    )
    results: dict[int, tuple[list[Rate], list[Rate], float]] = {}
    with Engine(model, tok, max_batch_size=max(args.concurrency), seed=0) as engine:
        await engine_run(engine, batch, 2, 1, 8)  # warm-up
        baseline(model, batch[:1], 8)
        for c in args.concurrency:
            ours, base = [], []
            engine.stats.clear()
            for _ in range(args.repeats):
                base.append(baseline(model, batch[: args.baseline_requests], args.max_tokens))
                ours.append(await engine_run(engine, batch, c, args.rounds, args.max_tokens))
            mean_batch = engine.stats["decode_tokens"] / max(1, engine.stats["steps"])
            results[c] = (ours, base, mean_batch)

    cols = [
        "concurrency",
        "engine tok/s",
        "generate tok/s",
        "ratio",
        "engine tok/CPU-s",
        "generate tok/CPU-s",
        "ratio",
        "mean batch",
    ]
    print("\n" + " | ".join(cols))
    print("-+-".join("-" * len(c) for c in cols))
    for c, (ours, base, mean_batch) in results.items():
        ow, bw = (statistics.median(r[0] for r in rs) for rs in (ours, base))
        oc, bc = (statistics.median(r[1] for r in rs) for rs in (ours, base))
        cells = [
            f"{c}",
            f"{ow:.0f}",
            f"{bw:.0f}",
            f"{ow / bw:.2f}x",
            f"{oc:.0f}",
            f"{bc:.0f}",
            f"{oc / bc:.2f}x",
            f"{mean_batch:.1f}",
        ]
        print(" | ".join(cell.rjust(len(col)) for cell, col in zip(cells, cols, strict=True)))
    print(
        f"\nmedians of {args.repeats} interleaved repeats; generate = model.generate, one "
        "request at a time, measured in the same run"
    )


if __name__ == "__main__":
    asyncio.run(main())
