"""Per-role LoRA adapters against one shared adapter (and a frozen role, or full
fine-tuning), on the SQL agent.

The LangGraph SQL agent has three roles: ``write`` and ``rewrite`` produce the query,
``check`` reviews its result and decides whether to rewrite. Its CPU recipes
(``samples/sql_agent/recipe.py``: ``RECIPE`` for a tiny student, ``RECIPES[model]`` for a
pretrained one) record a scripted teacher through the real graph, warm the student up on it
with SFT, then train it with LocalRL. Here, per seed, one warm-up is shared by the RL arms,
which start from the same warmed weights with the recipe's RL settings and differ in how the
roles' calls are served and trained:

- **two adapters**: ``lora_adapters={"writer": "write|rewrite", "checker": "check"}``, every
  role trained on its own adapter;
- **one shared adapter**: plain LoRA (``use_lora=True``), every role's calls trained on the
  same adapter (no agent filter);
- **checker frozen**: ``lora_adapters={"writer": "write|rewrite"}``: the writer's adapter
  trained, the checker's calls served by the warmed model and not trained;
- **full fine-tuning**: every weight, every role.

``--model tiny`` (the default) runs two adapters, one shared adapter and full fine-tuning;
``--model smollm2-135m-instruct`` runs one shared adapter, two adapters and checker frozen.
A LoRA arm's learning rate is the recipe's when the recipe trains LoRA (SmolLM2), ten times
the recipe's full-fine-tuning rate otherwise (tiny).

Held-out reward is measured after the warm-up (the arms of a seed share it) and after RL.
The table (arm, seed, after warm-up, after RL, change, minutes, peak memory, tokens trained)
and a plot of the held-out curves go to ``<out>/lora_adapters[-<model>]/``, with every row run
so far (one JSON file per arm and seed, so seeds can run in parallel processes).

    python benchmarks/lora_adapters_learning.py --seeds 0 1 2
    python benchmarks/lora_adapters_learning.py --model smollm2-135m-instruct --seeds 0 1 2
    make bench-lora-learning SEEDS="0 1 2"
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

import voltrl as vl

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "samples"), str(ROOT / "benchmarks")]
from intervals import interval  # noqa: E402
from recipe_runner import warm_up  # noqa: E402

ROLES = {"writer": "write|rewrite", "checker": "check"}
LORA = {"use_lora": True, "lora_r": 16, "lora_alpha": 32}
ARMS: dict[str, dict[str, Any]] = {
    "two adapters": {"lora_adapters": ROLES, "update": LORA},
    "one shared adapter": {"update": LORA},
    "checker frozen": {"lora_adapters": {"writer": ROLES["writer"]}, "update": LORA},
    "full fine-tuning": {"update": {}},
}
TINY = "tiny"
ARMS_OF = {
    TINY: ("two adapters", "one shared adapter", "full fine-tuning"),
    "smollm2-135m-instruct": ("one shared adapter", "two adapters", "checker frozen"),
}
"""The arms run by default for each model."""


def tag(model: str) -> str:
    """The model's part of run and report names: none for the tiny model (its runs of
    2026-11-23 are named without one)."""
    return "" if model == TINY else f"-{model}"


def arm_update(recipe_update: dict[str, Any], arm: str) -> dict[str, Any]:
    """The arm's ``update`` settings from the recipe's: LoRA on or off, and the learning
    rate for it (a recipe that trains LoRA gives a LoRA rate; one that trains every weight a
    rate ten times smaller than LoRA wants)."""
    lora_arm = bool(ARMS[arm]["update"].get("use_lora"))
    lora_recipe = bool(recipe_update.get("use_lora"))
    scale = 1.0 if lora_arm == lora_recipe else (10.0 if lora_arm else 0.1)
    update = {k: v for k, v in recipe_update.items() if k != "use_lora"}
    lora = {k: update.pop(k, v) for k, v in LORA.items() if k != "use_lora"}
    return {**update, **(LORA | lora if lora_arm else {}), "lr": recipe_update["lr"] * scale}


def run_arm(
    recipe: Any,
    model: str,
    arm: str,
    seed: int,
    warmed: Path,
    out: Path,
    rl_steps: int | None,
    threads: int | None,
    micro_batch_size: int | None = None,
) -> dict[str, Any]:
    """One RL arm from the warmed model; its row of the table. ``micro_batch_size``: the
    update's, when not the recipe's (the same gradient in less memory)."""
    _, train, val = recipe.tasks(seed)
    rl = dict(recipe.rl)
    rl["trajectory"] = {k: v for k, v in rl["trajectory"].items() if k != "agent_filter"}
    if rl_steps:
        rl["schedule"] = {**rl["schedule"], "steps": rl_steps}
    rl["update"] = arm_update(rl["update"], arm)
    if micro_batch_size:
        rl["update"]["micro_batch_size"] = micro_batch_size
    if threads:
        rl["compute"] = {**rl.get("compute", {}), "threads": threads}
    algorithm = vl.LocalRL(
        str(warmed),
        tokenizer=AutoTokenizer.from_pretrained(warmed),
        seed=seed,
        lora_adapters=ARMS[arm].get("lora_adapters"),
        **rl,
    )
    name = f"sql_agent{tag(model)}-{arm.replace(' ', '-')}-seed{seed}"
    started = time.time()
    trainer = vl.Trainer(
        algorithm, n_runners=1, max_concurrency=recipe.concurrency, run_dir=out, name=name
    )
    trainer.fit(recipe.agent, train, val)
    history = algorithm.history
    val_points = [(h["step"], h["val/reward_mean"]) for h in history if "val/reward_mean" in h]
    tokens: dict[str, float] = {}  # tokens with a non-zero advantage, per adapter
    for h in history:
        for key, value in h.items():
            parts = key.split("/")
            if parts[0] == "update" and parts[-1] == "adv_tokens":
                who = parts[1] if len(parts) == 3 else "all"
                tokens[who] = tokens.get(who, 0.0) + value
    peaks = [h["memory/peak_gib"] for h in history if "memory/peak_gib" in h]
    return {
        "arm": arm,
        "model": model,
        "seed": seed,
        "after_sft": val_points[0][1],
        "after_rl": val_points[-1][1],
        "val_curve": val_points,
        "minutes": (time.time() - started) / 60,
        "peak_gib": max(peaks) if peaks else None,
        "tokens": tokens,
        "lr": rl["update"]["lr"],
        "micro_batch_size": rl["update"].get("micro_batch_size"),
    }


def final_of(out: Path, model: str, arm: str, seed: int) -> Path:
    """The newest ``final/`` of the arm's runs for ``seed``."""
    found = sorted(
        out.glob(f"sql_agent{tag(model)}-{arm.replace(' ', '-')}-seed{seed}*/final/config.json"),
        key=lambda p: p.stat().st_mtime,
    )
    if not found:
        raise SystemExit(f"no finished run of {arm!r} for seed {seed} in {out}")
    return found[-1].parent


def evaluate(
    recipe: Any,
    model_name: str,
    arms: list[str],
    seed: int,
    out: Path,
    repeats: int,
    threads: int | None,
) -> None:
    """Held-out reward of the warmed model and of each arm's final weights, each held-out
    task sampled ``repeats`` times (sampled once, each of n held-out tasks moves the figure by
    100/n points): LocalRL with ``steps=0`` validates once."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, _, val = recipe.tasks(seed)
    sampling = recipe.rl["validation"]["sampling"]
    warm = (
        out / f"sql_agent{tag(model_name)}-adapters-warm-seed{seed}-{recipe.sft['steps']}" / "final"
    )
    models: dict[str, Any] = {"after warm-up": (str(warm), None)}
    for arm in arms:
        final = final_of(out, model_name, arm, seed)
        roles = ARMS[arm].get("lora_adapters")
        if not roles:
            models[arm] = (str(final), None)  # full weights (LoRA merged in)
            continue
        model: Any = AutoModelForCausalLM.from_pretrained(final)
        for k, name in enumerate(roles):
            path = final / "adapters" / name
            if k == 0:
                model = PeftModel.from_pretrained(model, path, adapter_name=name)
            else:
                model.load_adapter(path, adapter_name=name)
        models[arm] = (model, roles)
    report = out / f"lora_adapters{tag(model_name)}"
    for label, (model, roles) in models.items():
        algorithm = vl.LocalRL(
            model,
            tokenizer=AutoTokenizer.from_pretrained(warm),
            schedule={"steps": 0},
            validation={"every": 1, "sampling": sampling},
            compute={"threads": threads},
            sampling=sampling,
            lora_adapters=roles,
            seed=seed,
        )
        name = f"sql_agent{tag(model_name)}-eval-{label.replace(' ', '-')}-seed{seed}"
        trainer = vl.Trainer(
            algorithm, n_runners=1, max_concurrency=recipe.concurrency, run_dir=out, name=name
        )
        trainer.fit(recipe.agent, val[:1], val * repeats)
        (reward,) = [h["val/reward_mean"] for h in algorithm.history if "val/reward_mean" in h]
        row = {
            "model": label,
            "seed": seed,
            "held_out": reward,
            "samples": len(val) * repeats,
            "repeats": repeats,
        }
        (report / f"eval-{label.replace(' ', '-')}-seed{seed}.json").write_text(json.dumps(row))
        print(f"{label}, seed {seed}: {reward:.1%} of {len(val) * repeats} samples", flush=True)


def eval_table(report: Path, held_out: int) -> list[str]:
    """The evaluations: one column per seed, then the mean."""
    rows = [json.loads(p.read_text()) for p in report.glob("eval-*.json")]
    if not rows:
        return []
    seeds = sorted({r["seed"] for r in rows})
    repeats = rows[0].get("repeats") or rows[0]["samples"] / held_out
    lines = [
        f"| held-out, sampled {repeats:g}x | "
        + " | ".join(f"seed {s}" for s in seeds)
        + " | mean |",
        "|---|" + "---|" * (len(seeds) + 1),
    ]
    for label in ["after warm-up", *ARMS]:
        got = {r["seed"]: r["held_out"] for r in rows if r["model"] == label}
        if not got:
            continue
        cells = [f"{got[s]:.1%}" if s in got else "-" for s in seeds]
        lines.append(
            f"| {label} | " + " | ".join(cells) + f" | {statistics.mean(got.values()):.1%} |"
        )
    return lines


def table(rows: list[dict[str, Any]], arms: list[str]) -> list[str]:
    """One line per arm and seed, then each arm's mean with its 95% interval over seeds."""
    lines = [
        "| arm | seed | after warm-up | after RL | change | RL minutes | peak memory "
        "| tokens trained |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        runs = [r for r in rows if r["arm"] == arm]
        for r in runs:
            tokens = ", ".join(f"{k} {v:,.0f}" for k, v in r["tokens"].items())
            peak = f"{r['peak_gib']:.1f} GiB" if r.get("peak_gib") else "-"
            lines.append(
                f"| {arm} | {r['seed']} | {r['after_sft']:.1%} | {r['after_rl']:.1%} "
                f"| {(r['after_rl'] - r['after_sft']) * 100:+.1f} pts | {r['minutes']:.1f} "
                f"| {peak} | {tokens} |"
            )
        if len(runs) > 1:
            before = statistics.mean(r["after_sft"] for r in runs)
            after, half = interval([r["after_rl"] for r in runs])
            change, change_half = interval([r["after_rl"] - r["after_sft"] for r in runs])
            peaks = [r["peak_gib"] for r in runs if r.get("peak_gib")]
            lines.append(
                f"| **{arm}** | mean of {len(runs)} | {before:.1%} "
                f"| {after:.1%} ± {half * 100:.1f} "
                f"| **{change * 100:+.1f} ± {change_half * 100:.1f} pts** "
                f"| {statistics.mean(r['minutes'] for r in runs):.1f} "
                f"| {f'{max(peaks):.1f} GiB' if peaks else '-'} | |"
            )
    return lines


def plot(rows: list[dict[str, Any]], arms: list[str], title: str, path: Path) -> None:
    """Held-out reward per update, one colour per arm, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k_arm, arm in enumerate(arms):
        for k, r in enumerate(r for r in rows if r["arm"] == arm):
            ax.plot(
                *zip(*r["val_curve"], strict=True),
                "o-",
                color=f"C{k_arm}",
                alpha=0.8,
                label=arm if k == 0 else None,
            )
    top = max((y for r in rows for _, y in r["val_curve"]), default=0.0)
    ax.set(
        xlabel="policy update (0: after the shared SFT warm-up)",
        ylabel="held-out execution match",
        title=title,
        ylim=(-0.02, min(1.02, max(0.3, top + 0.05))),
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--model",
        default=TINY,
        choices=list(ARMS_OF),
        help="the student: the sample's tiny recipe, or a pretrained model's (default: tiny)",
    )
    parser.add_argument(
        "--arms", nargs="+", choices=list(ARMS), help="default: the model's (see above)"
    )
    parser.add_argument("--sft-steps", type=int, help="default: the recipe's")
    parser.add_argument("--rl-steps", type=int, help="default: the recipe's")
    parser.add_argument("--out", type=Path, default=Path("runs"))
    parser.add_argument(
        "--threads", type=int, help="torch threads (1 when seeds run in parallel processes)"
    )
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        help="the RL update's micro-batch (default: the recipe's; smaller takes less memory "
        "for the same gradient, as seeds in parallel processes need)",
    )
    parser.add_argument(
        "--evaluate",
        type=int,
        metavar="N",
        help="then evaluate the warm-up and each arm on every held-out task sampled N times",
    )
    parser.add_argument(
        "--evaluate-only", action="store_true", help="evaluate the seeds' finished runs only"
    )
    args = parser.parse_args(argv)
    from learning import load_recipe

    recipe = load_recipe("sql_agent", args.model)
    arms = args.arms or list(ARMS_OF[args.model])
    report = args.out / f"lora_adapters{tag(args.model)}"
    report.mkdir(parents=True, exist_ok=True)
    for seed in [] if args.evaluate_only else args.seeds:
        warmed, warm_minutes = warm_up(
            recipe, seed, args.out, steps=args.sft_steps, threads=args.threads
        )
        for arm in arms:
            row = run_arm(
                recipe,
                args.model,
                arm,
                seed,
                warmed,
                args.out,
                args.rl_steps,
                args.threads,
                args.micro_batch_size,
            )
            row["warm_minutes"] = warm_minutes
            # one file per arm and seed: several seeds may run at once, in separate processes
            (report / f"{arm.replace(' ', '-')}-seed{seed}.json").write_text(json.dumps(row))
            print(
                f"{arm}, seed {seed}: held-out {row['after_sft']:.1%} -> {row['after_rl']:.1%} "
                f"({row['minutes']:.1f} min)",
                flush=True,
            )
    if args.evaluate or args.evaluate_only:
        for seed in args.seeds:
            evaluate(recipe, args.model, arms, seed, args.out, args.evaluate or 8, args.threads)
    rows = [json.loads(p.read_text()) for p in sorted(report.glob("*-seed*.json"))]
    rows = [r for r in rows if "arm" in r]
    shown = [a for a in ARMS if any(r["arm"] == a for r in rows)]
    rows.sort(key=lambda r: (shown.index(r["arm"]), r["seed"]))
    held_out = len(recipe.tasks(0)[2])
    lines = [*table(rows, shown), "", *eval_table(report, held_out)]
    (report / "table.md").write_text("\n".join(lines) + "\n")
    student = "tiny student" if args.model == TINY else args.model
    title = f"SQL agent (LangGraph, {student}): adapters per role or shared"
    plot(rows, shown, title, report / "held_out.png")
    print("\n".join(lines))
    print(f"table and plot in {report}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
