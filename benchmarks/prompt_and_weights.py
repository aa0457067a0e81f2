"""Prompt, weights, or both? The prompt_search sample's classifier, four ways, over seeds.

Each arm is one LocalRL run on the same model (SmolLM2-135M-Instruct by default), scored the
same way: LocalRL's greedy validation on the 24 held-out reviews (``samples/prompt_search``),
once before anything trains and once at the end. The arms:

- ``start``: the starting template ``{text}`` on the model as it is (no step);
- ``apo``: ``LocalRL(prompt_search=APO(...))`` with no step: APO's best template on the model;
- ``rl``: LocalRL's steps with the starting template (the trainer's ``prompt_template``);
- ``apo+rl``: ``LocalRL(prompt_search=APO(...))``: APO, then the steps with its template.

An arm not asked for is read from another's first validation where that is the same thing:
``start`` from ``rl``'s (the start template before any step) and ``apo`` from ``apo+rl``'s (APO's
best template, after the search, before any step), so ``--arms rl apo+rl`` gives all four rows
at half the cost. APO scores its candidates on the same held-out reviews, so its rows are the
score of the best of several tries on them (optimistic by selection); LocalRL's are not.

The table gives each arm's held-out score per seed, the mean and a 95% interval over seeds
(Student's t), and the mean change against ``start``; a closing line says whether ``apo+rl``
beat the better single phase by more than the intervals' overlap. APO's optimizer is the model
being trained unless ``--optimizer-endpoint`` names another (a 135M model rewrites poorly:
``samples/prompt_search/README.md``).

    python benchmarks/prompt_and_weights.py --arms start apo rl apo+rl --seeds 0 1 2
    python benchmarks/prompt_and_weights.py --seeds 0 --rounds 1 --steps 1 \\
        --tasks-per-step 2 --group-size 2 --val-size 4          # a smoke run, minutes on a CPU

Rows go to ``<out>/prompt_and_weights.json`` (one per arm and seed, with its settings), the table
to ``<out>/prompt_and_weights.md``; the run directories are deleted unless ``--keep-runs``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "prompt_search"
sys.path[:0] = [str(SAMPLE), str(ROOT / "benchmarks")]
for _name in ("agent", "data"):  # another sample's, imported by the same plain name (the tests)
    _module = sys.modules.get(_name)
    if _module is not None and Path(getattr(_module, "__file__", "") or "/").parent != SAMPLE:
        del sys.modules[_name]

import data  # noqa: E402
from agent import START, classify  # noqa: E402
from intervals import interval  # noqa: E402

import voltrl as vl  # noqa: E402

ARMS = ("start", "apo", "rl", "apo+rl")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--model", default="smollm2-135m-instruct", help="the trained model")
    p.add_argument("--steps", type=int, default=12, help="LocalRL steps (rl, apo+rl)")
    p.add_argument("--tasks-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4, help="LoRA learning rate")
    p.add_argument("--rounds", type=int, default=3, help="APO rounds (apo, apo+rl)")
    p.add_argument("--beam-width", type=int, default=2)
    p.add_argument("--branch-factor", type=int, default=2)
    p.add_argument("--train-batch", type=int, default=8, help="APO's training reviews a round")
    p.add_argument("--val-size", type=int, help="held-out reviews scored (default: all 24)")
    p.add_argument("--optimizer-endpoint", help="APO's optimizer (default: the trained model)")
    p.add_argument("--optimizer-model", help="its model name")
    p.add_argument("--optimizer-key-env", help="environment variable holding its API key")
    p.add_argument(
        "--optimizer-temperature",
        type=float,
        default=0.3,
        help="the optimizer's sampling temperature (a 0.5B optimizer rambles at 0.7 and above)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--out", type=Path, default=Path("runs/prompt_and_weights"))
    p.add_argument("--keep-runs", action="store_true", help="keep each arm's run directory")
    return p


def algorithm(arm: str, seed: int, args: argparse.Namespace) -> vl.LocalRL:
    """The arm's LocalRL: steps for ``rl`` arms, a prompt search for ``apo`` arms."""
    search = None
    if arm.startswith("apo"):
        optimizer = None
        if args.optimizer_endpoint:
            optimizer = vl.LLM(
                endpoint=args.optimizer_endpoint,
                model=args.optimizer_model or args.model,
                api_key_env=args.optimizer_key_env,
            )
        search = vl.APO(
            START,
            optimizer_llm=optimizer,
            rounds=args.rounds,
            beam_width=args.beam_width,
            branch_factor=args.branch_factor,
            train_batch_size=args.train_batch,
            optimizer_sampling={"temperature": args.optimizer_temperature, "max_tokens": 256},
            answer_key="label",  # the review's label: quoted as the expected answer
            seed=seed,
        )
    steps = args.steps if arm.endswith("rl") else 0
    sampling = {"temperature": 1.0, "max_tokens": 12}
    return vl.LocalRL(
        args.model,
        seed=seed,
        schedule={
            "steps": steps,
            "tasks_per_step": args.tasks_per_step,
            "group_size": args.group_size,
        },
        sampling=sampling,
        validation={"every": max(steps, 1), "n": 1},  # before the first step and after the last
        update={"use_lora": True, "lr": args.lr, "micro_batch_size": 16, "clip_eps": 0.2},
        compute={"threads": args.threads},
        checkpoints={"every": 0},
        prompt_search=search,
    )


def run_arm(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One arm, one seed: its held-out score at the end (and at its start)."""
    name = f"{arm.replace('+', '-')}-seed{seed}"
    algo = algorithm(arm, seed, args)
    # without a search the agent still needs its template: the trainer's resource
    resources = {} if algo.prompt_search else {"prompt_template": vl.PromptTemplate(template=START)}
    val = data.rows("val")[: args.val_size]
    t0, started = time.perf_counter(), time.time()
    result = vl.Trainer(
        algo,
        resources=resources,
        inline=True,
        max_concurrency=64,
        run_dir=args.out / "runs",
        name=name,
    ).fit(classify, data.rows("train"), val_dataset=val)
    scores = [m["val/reward_mean"] for m in result.metrics if "val/reward_mean" in m]
    best, search = None, {}
    if algo.prompt_search:
        best = json.loads((result.run_dir / "final" / "prompt_template.json").read_text())
        search = search_summary(result.run_dir, started)
    row = {
        "arm": arm,
        "seed": seed,
        "score": scores[-1],
        "first_validation": scores[0],
        "template": best["template"] if best else START,
        "minutes": (time.perf_counter() - t0) / 60,
        "val_rows": len(val),
        **search,
        "settings": {k: v for k, v in vars(args).items() if k not in ("arms", "seeds", "out")},
    }
    if not args.keep_runs:
        shutil.rmtree(result.run_dir, ignore_errors=True)
    return row


def search_summary(run_dir: Path, started: float) -> dict[str, Any]:
    """APO's search in an arm's run (its ``prompt_search.json`` and ``metrics.jsonl``): the
    best score after each round, the refusals by reason, the repaired rewrites, and the minutes
    from the run's start (``started``, epoch seconds; the model's loading included) to the
    search's end."""
    cands = json.loads((run_dir / "prompt_search.json").read_text())["candidates"]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = [m for m in logged if m.get("apo/best_score") is not None]
    refused = Counter(c["reason"] for c in cands if c["status"] in ("rejected", "failed"))
    return {
        "search_best_per_round": [m["apo/best_score"] for m in rounds],
        "search_rewrites": sum(1 for c in cands if c["round"] > 0),
        "search_refused": dict(refused),
        "search_repaired": sum(1 for c in cands if c.get("repaired")),
        "search_minutes": (rounds[-1]["time"] - started) / 60 if rounds else None,
    }


def derived(rows: list[dict[str, Any]], arms: list[str]) -> list[dict[str, Any]]:
    """``start`` rows from ``rl``'s first validations and ``apo`` rows from ``apo+rl``'s, for
    the arms not run themselves."""
    extra = []
    for arm, source in (("start", "rl"), ("apo", "apo+rl")):
        if arm in arms:
            continue
        for r in rows:
            if r["arm"] == source:
                extra.append({**r, "arm": arm, "score": r["first_validation"], "from": source})
    return extra


def table(rows: list[dict[str, Any]], arms: list[str]) -> list[str]:
    """The markdown table, then what it says about one phase against both."""
    by_arm = {a: [r["score"] for r in rows if r["arm"] == a] for a in arms}
    start = statistics.fmean(by_arm["start"]) if by_arm.get("start") else None
    lines = [
        "| arm | held-out score per seed | mean | 95% interval | vs start |",
        "|---|---|---:|---:|---:|",
    ]
    stats = {}
    for arm in arms:
        if not by_arm[arm]:
            continue
        mean, half = stats[arm] = interval(by_arm[arm])
        shown = "n/a (1 seed)" if math.isnan(half) else f"{mean - half:.3f} to {mean + half:.3f}"
        change = "" if start is None else f"{mean - start:+.3f}"
        each = ", ".join(f"{s:.3f}" for s in by_arm[arm])
        lines.append(f"| {arm} | {each} | {mean:.3f} | {shown} | {change} |")
    singles = [a for a in ("apo", "rl") if a in stats]
    if "apo+rl" in stats and singles:
        better = max(singles, key=lambda a: stats[a][0])
        (both, h_both), (one, h_one) = stats["apo+rl"], stats[better]
        if math.isnan(h_both) or math.isnan(h_one):
            verdict = "one seed: no verdict"
        elif both - h_both > one + h_one:
            verdict = f"apo+rl beats {better} alone, the intervals apart"
        else:
            verdict = f"{better} alone is as good as both, within the intervals"
        lines.append(f"\napo+rl {both:.3f}, {better} alone {one:.3f}: {verdict}.")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.val_size is not None and args.val_size < 1:
        raise SystemExit("--val-size must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        for arm in args.arms:
            rows.append(run_arm(arm, seed, args))
            # written as each arm ends: a long sweep stopped half-way keeps what it measured
            (args.out / "prompt_and_weights.json").write_text(json.dumps(rows, indent=2) + "\n")
    rows += derived(rows, args.arms)
    (args.out / "prompt_and_weights.json").write_text(json.dumps(rows, indent=2) + "\n")
    shown = [a for a in ARMS if any(r["arm"] == a for r in rows)]
    lines = table(rows, shown)
    (args.out / "prompt_and_weights.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    for r in rows:
        if r["arm"].startswith("apo") and "from" not in r:
            print(
                f"{r['arm']} seed {r['seed']}: best after each round {r['search_best_per_round']}, "
                f"{r['search_rewrites']} rewrites, {r['search_repaired']} repaired, refused "
                f"{r['search_refused'] or 'none'}, search {r['search_minutes'] or 0:.1f} min, "
                f"template {r['template']!r}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
