"""Does every framework sample learn? Runs the samples' CPU recipes and prints one table.

Each recipe (``samples/<sample>/recipe.py``, runner in ``samples/recipe_runner.py``) records a
scripted teacher's rollouts through the real framework and gateway, fine-tunes a tiny model
from scratch on the good ones (``vl.SFT``), then trains it with LocalRL; held-out reward is
measured after the warm-up and after RL. The table: sample, framework, after warm-up, after
RL, change, minutes (SFT + RL of one seed; the teacher run is recorded once and reused),
merge rate of the RL rows (trajectory mode), tokens trained (SFT / RL). It is written to
``<out>/learning/table.md`` (with the latest rows of samples run before), each sample's rows to
``<sample>.json``, with one reward-curve PNG per sample.

    python benchmarks/learning.py                         # every sample, seed 0
    python benchmarks/learning.py autogen_calc --seeds 0 1 2
    make learn SAMPLE=autogen_calc SEEDS="0 1 2"

``--model smollm2-135m-instruct`` runs the recipes of a pretrained model instead (a sample's
``RECIPES``: every sample above and ``calculator``): the model is fetched once (``voltrl model
fetch``), warmed up on the teacher's rollouts and trained with LoRA; its table and rows are
``table-<model>.md`` and ``<sample>-<model>.json``. A sample's rows keep the latest run of
each seed measured with the same settings: ``--seeds 1 2`` after ``--seeds 0`` gives a
table of three.

``werewolf`` runs only when named, in the AgentScope environment, one side a run (``--side
wolves|village``, default wolves); its rows are ``werewolf-<side>[-<model>].json`` and its
figures (win rates with 95% intervals, the two-proportion test, draws, legal answers, what
the players did) ``werewolf[-<model>].md`` besides the table::

    .venv-agentscope/bin/python benchmarks/learning.py werewolf --side wolves --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ("autogen_calc", "calc_mcp", "agent_service", "sql_agent")
TINY = "tiny"
SAMPLES_OF = {
    TINY: SAMPLES,
    "smollm2-135m-instruct": (
        "calculator",
        "autogen_calc",
        "calc_mcp",
        "agent_service",
        "sql_agent",
    ),
}
"""Which samples have a recipe for each model (run when no sample is named)."""
NAMED_ONLY = {"werewolf": ("wolves", "village")}
"""Samples run only when named, and their variants (``--side``): werewolf needs AgentScope's
environment, where the other samples' frameworks are not installed."""
sys.path.insert(0, str(ROOT / "samples"))


def load_recipe(sample: str, model: str = TINY, side: str | None = None) -> Any:
    """The recipe of ``samples/<sample>/recipe.py`` for ``model``: ``RECIPES[model]``, or
    ``RECIPE`` for the tiny model; ``side``: the module's ``with_side(recipe, side)``
    (werewolf's side trained).

    Samples import their siblings by plain names (``agent``, ``data``), so the modules another
    sample loaded under those names are dropped from ``sys.modules`` first: several samples'
    recipes can load in one process (the table of every sample, the tests).
    """
    if side is not None and sample not in NAMED_ONLY:
        raise SystemExit(f"--side is for {' and '.join(NAMED_ONLY)}'s recipes; {sample} has none")
    path = ROOT / "samples" / sample / "recipe.py"
    for name, module in list(sys.modules.items()):
        origin = Path(getattr(module, "__file__", None) or "/").resolve()
        if origin.parent.parent == ROOT / "samples" and origin.parent.name != sample:
            del sys.modules[name]
    known = ", ".join((*SAMPLES_OF.get(model, ()), *NAMED_ONLY))
    if not path.exists():
        raise SystemExit(f"no recipe for {sample!r} ({path}); samples: {known}")
    spec = importlib.util.spec_from_file_location(f"{sample}_recipe", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as exc:  # werewolf's AgentScope is not in the main environment
        if sample not in NAMED_ONLY:
            raise
        raise SystemExit(
            f"{sample}'s recipe needs {exc.name}, not installed here: run it in the AgentScope "
            "environment (.venv-agentscope/bin/python benchmarks/learning.py ...)"
        ) from None
    recipes = {
        **getattr(module, "RECIPES", {}),
        **({TINY: module.RECIPE} if hasattr(module, "RECIPE") else {}),
    }
    if model not in recipes:
        raise SystemExit(
            f"{sample} has no recipe for the model {model!r} (it has: {', '.join(recipes)}); "
            f"samples with one: {known or 'none'}"
        )
    return recipes[model] if side is None else module.with_side(recipes[model], side)


def name_of(row: dict[str, Any]) -> str:
    """A row's recipe as the table names it: the sample, and its variant (``werewolf
    (wolves)``)."""
    return f"{row['sample']} ({row['variant']})" if row.get("variant") else row["sample"]


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown table: one line per sample and seed, then each sample's mean."""
    head = (
        "| sample | framework | seed | after warm-up | after RL | change | minutes "
        "| merge rate | tokens trained (SFT / RL) |"
    )
    lines = [head, "|" + "---|" * 9]
    by_sample: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_sample.setdefault(name_of(r), []).append(r)
    for sample, runs in by_sample.items():
        for r in runs:
            if r["after_sft"] is None or r["after_rl"] is None:
                lines.append(f"| {sample} | {r['framework']} | {r['seed']} | no validation |||||")
                continue
            change = (r["after_rl"] - r["after_sft"]) * 100
            merge = "-" if r["merge_rate"] is None else f"{r['merge_rate']:.0%}"
            lines.append(
                f"| {sample} | {r['framework']} | {r['seed']} | {pct(r['after_sft'])} "
                f"| {pct(r['after_rl'])} | {change:+.1f} pts | {r['minutes']:.1f} | {merge} "
                f"| {r['sft_tokens']:,} / {r['rl_tokens']:,.0f} |"
            )
        runs = [r for r in runs if r["after_sft"] is not None and r["after_rl"] is not None]
        if len(runs) > 1:
            before = statistics.mean(r["after_sft"] for r in runs)
            after = statistics.mean(r["after_rl"] for r in runs)
            lines.append(
                f"| **{sample}** | mean of {len(runs)} | | {pct(before)} | {pct(after)} "
                f"| **{(after - before) * 100:+.1f} pts** "
                f"| {statistics.mean(r['minutes'] for r in runs):.1f} | | |"
            )
    return lines


def plot(sample: str, rows: list[dict[str, Any]], path: Path) -> None:
    """Held-out reward (after warm-up, during and after RL) and training reward per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        (line,) = ax.plot(
            *zip(*r["val_curve"], strict=True), "o-", label=f"held-out, seed {r['seed']}"
        )
        if r["train_curve"]:
            ax.plot(*zip(*r["train_curve"], strict=True), color=line.get_color(), alpha=0.35)
    ax.set(
        xlabel="policy update (0: after SFT warm-up)",
        ylabel="mean reward",
        title=f"{sample} ({rows[0].get('model', TINY)})\nSFT warm-up, then LocalRL "
        "(faint: training reward)",
        ylim=(-0.02, 1.02),
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("samples", nargs="*", help="default: every sample with a recipe")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0],
        help="one run per seed (default: 0); each replaces that seed's row",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=Path("runs"),
        help="where the runs go; the rows, tables and plots go to OUT/learning (default: runs)",
    )  # fmt: skip
    parser.add_argument(
        "--model", default=TINY, choices=sorted(SAMPLES_OF), help="the student (default: tiny)"
    )
    parser.add_argument(
        "--side", choices=NAMED_ONLY["werewolf"], default=None,
        help="werewolf: the side trained (default: its recipe's, the wolves)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.side and not set(args.samples) & set(NAMED_ONLY):
        parser.error(f"--side is for {', '.join(NAMED_ONLY)}: name it")
    from recipe_runner import label, run_recipe

    samples = (*SAMPLES_OF[args.model], *NAMED_ONLY)
    args.samples = args.samples or list(SAMPLES_OF[args.model])
    suffix = "" if args.model == TINY else f"-{args.model}"
    report = args.out / "learning"
    report.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}  # sample -> its recipe's table_lines, for its rows
    for sample in args.samples:
        recipe = load_recipe(sample, args.model, args.side if sample in NAMED_ONLY else None)
        if recipe.table_lines is not None:
            extra[sample] = recipe.table_lines
        done = [run_recipe(recipe, seed, args.out) for seed in args.seeds]
        for r in done:
            print(
                f"{sample} seed {r['seed']}: held-out {pct(r['after_sft'])} after warm-up, "
                f"{pct(r['after_rl'])} after RL ({r['minutes']:.1f} min)",
                flush=True,
            )
        # the sample's rows: this run's seeds, and the latest of seeds run before with the
        # same recipe settings
        path = report / f"{label(recipe)}{suffix}.json"
        ran = {r["seed"] for r in done}
        before = json.loads(path.read_text()) if path.exists() else []
        earlier = [r for r in before if r["seed"] not in ran]
        same = [r for r in earlier if r.get("recipe") == done[0]["recipe"]]
        if len(same) < len(earlier):
            seeds = sorted(r["seed"] for r in earlier if r not in same)
            print(f"{sample}: dropped the rows of seeds {seeds}: measured with other settings")
        kept = sorted(same + done, key=lambda r: r["seed"])
        path.write_text(json.dumps(kept, indent=1))
        plot(name_of(kept[0]), kept, report / f"{label(recipe)}{suffix}.png")
        rows += kept
    # the table: this run's samples, and the latest rows of samples run before
    for sample in samples:
        for variant in NAMED_ONLY.get(sample, ("",)):
            path = report / f"{sample}{'-' * bool(variant)}{variant}{suffix}.json"
            ran = {(r["sample"], r.get("variant", "")) for r in rows}
            if (sample, variant) not in ran and path.exists():
                rows += json.loads(path.read_text())
    rows.sort(key=lambda r: (samples.index(r["sample"]), r.get("variant", ""), r["seed"]))
    lines = table_lines(rows)
    (report / f"table{suffix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    for sample, lines_of in extra.items():  # a recipe's own figures, its rows of both variants
        lines = lines_of([r for r in rows if r["sample"] == sample])
        (report / f"{sample}{suffix}.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    print(f"table and curves in {report}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
