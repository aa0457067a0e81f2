"""The train-inference mismatch on the demo, measured and corrected: ``make demo``'s calculator
agent, its float32 policy served in float32 (the baseline), served in bfloat16
(``serving.dtype``) as vLLM serves an FSDP policy, and served in bfloat16 with the rollout
correction (``update.rollout_correction``: TIS, or MIS); each arm over the seeds given.

Prints, per arm, the mismatch the updates measured (``mismatch/*``, the mean over steps and
seeds, and its ratio to the float32 baseline's), the correction's shares, and held-out accuracy
after the warm-up and after RL; writes ``<out>/fidelity/mismatch.png`` (the mismatch and the
held-out accuracy per step, one line per arm) and ``results.json``.

    python benchmarks/fidelity.py --seeds 0 1 2
    python benchmarks/fidelity.py --seeds 0 --arms float32 bfloat16 bfloat16+tis --steps 30
    python benchmarks/fidelity.py --engine vllm     # in make test-vllm's environment

The warm-up is the demo's (cached under ``<out>/.cache``), so arms of one seed start from the
same weights; each arm's run directory is ``<out>/fidelity/<arm>-seed<N>``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "samples" / "calculator"), str(ROOT / "samples")]

ARMS: dict[str, dict[str, Any]] = {
    "float32": {},
    "bfloat16": {"serving": {"dtype": "bfloat16"}},
    "bfloat16+tis": {"serving": {"dtype": "bfloat16"}, "update": {"rollout_correction": "tis"}},
    "bfloat16+mis": {"serving": {"dtype": "bfloat16"}, "update": {"rollout_correction": "mis"}},
}
"""Each arm's settings on top of the demo's ``algorithm`` section."""
MISMATCH = (
    "mismatch/logprob_abs_mean",
    "mismatch/logprob_abs_max",
    "mismatch/kl",
    "mismatch/tokens_over",
)


def run_arm(arm: str, seed: int, out: Path, steps: int, engine: str) -> dict[str, Any]:
    """One arm of one seed: the demo's run with the arm's settings; its curves and figures."""
    import shutil

    import yaml
    from demo import warm_model, write_run_files

    from voltrl.cli import build_from_config

    model_path = warm_model(seed, out / ".cache")
    run_dir = out / "fidelity" / f"{arm}-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    config = yaml.safe_load(write_run_files(run_dir, seed, model_path, steps).read_text())
    algorithm = config["algorithm"]
    for group, settings in ARMS[arm].items():
        algorithm[group] = {**algorithm.get(group, {}), **settings}
    if engine != "local":
        algorithm["serving"] = {**algorithm.get("serving", {}), "engine": engine}
    (run_dir / "train.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.time()
    trainer, agent, train, val = build_from_config(config)
    trainer.fit(agent, train, val)
    history = trainer.algorithm.history
    steps_logged = [h for h in history if "update/loss" in h]
    val_points = [(h["step"], h["val/reward_mean"]) for h in history if "val/reward_mean" in h]
    return {
        "arm": arm,
        "seed": seed,
        "engine": engine,
        "minutes": (time.time() - started) / 60,
        "before": val_points[0][1],
        "after": val_points[-1][1],
        "val_curve": val_points,
        "curves": {
            name: [(h["step"], h[name]) for h in steps_logged if name in h]
            for name in (*MISMATCH, "mismatch/truncated", "mismatch/masked", "train/reward_mean")
        },
        "run_dir": str(run_dir),
    }


def mean_of(rows: list[dict[str, Any]], name: str) -> float | None:
    """The mean over steps and seeds of one curve (None where no step logged it)."""
    values = [v for r in rows for _, v in r["curves"].get(name, [])]
    return statistics.fmean(values) if values else None


def table(results: list[dict[str, Any]]) -> list[str]:
    """A Markdown table: per arm, the mismatch (and its ratio to float32's), the correction's
    shares, and held-out accuracy before and after RL (mean over seeds)."""
    arms = list(dict.fromkeys(r["arm"] for r in results))
    base = [r for r in results if r["arm"] == "float32"]
    base_abs = mean_of(base, "mismatch/logprob_abs_mean") if base else None
    lines = [
        "| arm | seeds | abs mean | x float32 | abs max | kl (k3) | tokens > 0.1 | truncated "
        "| masked | held-out before → after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for arm in arms:
        rows = [r for r in results if r["arm"] == arm]
        abs_mean = mean_of(rows, "mismatch/logprob_abs_mean")
        ratio = abs_mean / base_abs if abs_mean is not None and base_abs else None
        largest = max(
            (v for r in rows for _, v in r["curves"]["mismatch/logprob_abs_max"]), default=None
        )
        before = statistics.fmean(r["before"] for r in rows)
        after = statistics.fmean(r["after"] for r in rows)
        lines.append(
            f"| {arm} | {len(rows)} | {num(abs_mean, '.2e')} | {num(ratio, '.0f')} "
            f"| {num(largest, '.3f')} | {num(mean_of(rows, 'mismatch/kl'), '.1e')} "
            f"| {num(mean_of(rows, 'mismatch/tokens_over'), '.2%')} "
            f"| {num(mean_of(rows, 'mismatch/truncated'), '.2%')} "
            f"| {num(mean_of(rows, 'mismatch/masked'), '.2%')} | {before:.1%} → {after:.1%} |"
        )
    return lines


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Left: the mean logprob gap per step (log scale), one line per arm and seed; right:
    held-out accuracy per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors: dict[str, Any] = {}
    for r in results:
        color = colors.setdefault(r["arm"], f"C{len(colors)}")
        label = r["arm"] if r["seed"] == min(x["seed"] for x in results) else None
        curve = r["curves"]["mismatch/logprob_abs_mean"]
        if curve:
            left.plot(*zip(*curve, strict=True), color=color, alpha=0.8, label=label)
        right.plot(*zip(*r["val_curve"], strict=True), "o-", color=color, alpha=0.8, label=label)
    left.set(
        yscale="log",
        xlabel="policy update",
        ylabel="mean |engine - trainer| logprob",
        title="mismatch/logprob_abs_mean",
    )
    right.set(xlabel="policy update", ylabel="held-out accuracy", ylim=(-0.02, 1.02))
    right.set_title("held-out accuracy (0: after warm-up)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle("the calculator demo, a float32 policy served in float32 or bfloat16")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS)[:3])
    parser.add_argument("--steps", type=int, default=30, help="policy updates per run")
    parser.add_argument("--engine", default="local", choices=["local", "vllm"])
    parser.add_argument("--out", type=Path, default=Path("runs"))
    args = parser.parse_args(argv)
    results_path = args.out / "fidelity" / "results.json"
    results: list[dict[str, Any]] = []
    for seed in args.seeds:
        for arm in args.arms:
            print(f"== {arm}, seed {seed} ({args.engine} engine)", flush=True)
            results.append(run_arm(arm, seed, args.out, args.steps, args.engine))
            results_path.write_text(json.dumps(results, indent=1))
    lines = table(results)
    print("\n".join(lines))
    (args.out / "fidelity" / "table.md").write_text("\n".join(lines) + "\n")
    plot(results, args.out / "fidelity" / "mismatch.png")
    print(f"plot: {args.out / 'fidelity' / 'mismatch.png'}; rows: {results_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
