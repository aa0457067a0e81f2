"""`make demo`: train the calculator agent with LocalRL on this CPU and show it improve.

1. Build a tiny Qwen2 model and tokenizer in code, and warm it up on synthetic transcripts so
   it knows the chat and tool-call format: first transcripts that all call the calculator,
   until it copies the question into the call and the tool's result into the answer (95% of
   held-out transcripts, measured as the chance that sampling writes them right), then a
   phase of mostly direct answers that leaves it preferring mental arithmetic (cached under
   ``runs/.cache``).
2. Write the tasks and a ``voltrl train`` YAML config into the run directory.
3. Train with LocalRL through the real store (SQLite in ``runs/<name>/``), gateway, runner
   processes and inference engine, validating on held-out tasks before, during and after.
4. Print held-out accuracy before and after; LocalRL leaves ``reward_curve.png`` in the run
   directory (a re-run of a seed gets a directory of its own: ``calculator-seed0-2``...).

    python samples/calculator/demo.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from data import make_tasks, warmup_conversations  # noqa: E402
from sample_cli import HelpFormatter  # noqa: E402

MODEL = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2}
# Phase one: transcripts that all call the calculator, so the model learns the format and to
# copy the question into the call and the tool's result into its answer. When it has not yet
# learnt to copy, it trains on in rounds: how many steps that takes depends on the seed (one
# seed wrote the operator as + or * at random until its 1,400th step, then copied it).
WARMUP = {"steps": 800, "batch_size": 32, "lr": 2e-3, "transcripts": 4000, "p_tool": 1.0}
ROUNDS = {"steps": 200, "lr": 1e-3, "most": 6, "target": 0.95}
# Phase two: mostly direct answers, so the warmed model prefers mental arithmetic (it then
# calls the tool for about 9% of questions). Its first steps also undo some copying, which
# its later steps, on the 10% of transcripts that call the tool, largely restore: from one
# seed's phase-one model (97.5%), 100 steps left 79%, 200 left 89%, 400 left 88-91%.
SETTLE = {"steps": 400, "lr": 1e-3, "transcripts": 2000, "p_tool": 0.1}
VAL = {"tasks": 192, "seed": 999}  # the held-out questions, never trained on


def held_out() -> set[str]:
    """The validation questions: no warm-up transcript or RL task asks one of them."""
    return {t["question"] for t in make_tasks(VAL["tasks"], seed=VAL["seed"])}


def transcripts(n: int, seed: int, p_tool: float) -> list[dict[str, Any]]:
    """``n`` warm-up transcripts of questions not in the held-out set."""
    val = held_out()
    tasks = [t for t in make_tasks(n + VAL["tasks"], seed=seed) if t["question"] not in val]
    return warmup_conversations(tasks[:n], seed=seed, p_tool=p_tool)


def copy_rate(model: Any, tokenizer: Any, conversations: list[dict[str, Any]]) -> float:
    """How often ``model``, sampling at temperature 1 as the demo's rollouts do, would copy a
    tool-using transcript's question into its call and the tool's result into its answer: per
    transcript, the product of the probabilities of the call's tokens (after its first, which
    chooses to call) and of the answer's digits, averaged; one forward pass."""
    import torch

    from voltrl.algorithms.local.conversations import tokenize_conversation

    rows = [tokenize_conversation(tokenizer, c) for c in conversations]
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    token_logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    digits = {i for t, i in tokenizer.get_vocab().items() if t.lstrip("Ġ").isdigit()}
    total = 0.0
    for k, (row, mask) in enumerate(rows):
        trained = [j for j, m in enumerate(mask) if m]  # the call's tokens, then the answer's
        gaps = [i for i in range(1, len(trained)) if trained[i] != trained[i - 1] + 1]
        call, answer = trained[1 : gaps[0]], trained[gaps[-1] :]
        kept = call + [j for j in answer if row[j] in digits]
        total += float(token_logp[k, [j - 1 for j in kept]].sum().exp())
    return total / len(rows)


def warm_model(seed: int, cache: Path) -> Path:
    """A tiny model that knows the format, trained once per seed and cached."""
    import torch

    from voltrl.algorithms.local.supervised import supervised_warmup
    from voltrl.models.threads import usable_cpus
    from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer

    conversations = transcripts(WARMUP["transcripts"], 10_000 + seed, WARMUP["p_tool"])
    checks = transcripts(256, 30_000 + seed, 1.0)
    settle = transcripts(SETTLE["transcripts"], 20_000 + seed, SETTLE["p_tool"])
    key = json.dumps([MODEL, WARMUP, ROUNDS, SETTLE, VAL, seed], sort_keys=True)
    path = cache / f"calculator-warm-seed{seed}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    if (path / "config.json").exists():
        print(f"warm-up: using cached model {path}")
        return path
    torch.manual_seed(seed)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed, **MODEL)
    started = time.time()

    # Nothing else runs during the warm-up: it takes every CPU (LocalRL later takes half,
    # leaving the rest to the agent's runner process).
    threads = usable_cpus()
    done = 0

    def log(step: int, loss: float) -> None:
        if done == 0 and step == 0:
            print(f"warm-up: {threads} torch intra-op thread(s)", flush=True)
        if (done + step) % 200 == 0:
            print(
                f"warm-up step {done + step:5d}  loss {loss:.3f}  {time.time() - started:5.0f} s",
                flush=True,
            )

    def train(rows: list[dict[str, Any]], steps: int, lr: float, **kw: Any) -> None:
        nonlocal done
        supervised_warmup(
            model, tokenizer, rows, steps=steps, batch_size=WARMUP["batch_size"], lr=lr,
            threads=threads, log=log, **kw,
        )  # fmt: skip
        done += steps

    train(conversations, WARMUP["steps"], WARMUP["lr"], seed=seed)
    for r in range(ROUNDS["most"] + 1):
        rate = copy_rate(model, tokenizer, checks)
        print(
            f"warm-up: after {done} steps it copies the question and the result right in "
            f"{rate:.0%} of held-out transcripts (sampled; target {ROUNDS['target']:.0%})",
            flush=True,
        )
        if rate >= ROUNDS["target"] or r == ROUNDS["most"]:
            break
        train(conversations, ROUNDS["steps"], ROUNDS["lr"], warmup_steps=0, seed=seed + 100 + r)
    # Settle on transcripts that mostly answer directly: the warmed model then knows both
    # behaviours but prefers mental arithmetic, and RL has to discover that the tool pays.
    train(settle, SETTLE["steps"], SETTLE["lr"], warmup_steps=0, seed=seed + 1)
    print(
        f"warm-up: {done} steps in {time.time() - started:.0f} s; after settling it copies "
        f"{copy_rate(model, tokenizer, checks):.0%}",
        flush=True,
    )
    tmp = path.with_suffix(".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    return path


def write_run_files(run_dir: Path, seed: int, model_path: Path, steps: int) -> Path:
    """Tasks (train / held-out val, disjoint) and the ``voltrl train`` config; returns it."""
    import yaml

    val = make_tasks(VAL["tasks"], seed=VAL["seed"])
    questions = held_out()
    train = [t for t in make_tasks(3000, seed=2000 + seed) if t["question"] not in questions]
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("val", val)):
        (run_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sampling = {"temperature": 1.0, "max_tokens": 48}
    config: dict[str, Any] = {
        "agent": f"{HERE / 'agent.py'}:calculator_agent",
        "data": {"train": str(run_dir / "train.jsonl"), "val": str(run_dir / "val.jsonl")},
        "algorithm": {
            "name": "local_rl",
            "model": str(model_path),
            "schedule": {"steps": steps, "tasks_per_step": 8, "group_size": 8},
            "validation": {"sampling": sampling, "every": 10},
            "sampling": sampling,
            "seed": seed,
            # at 5e-4 RL undid the warmed model's copying on seed 1 (training reward 77% at
            # step 6, held-out accuracy 33% at step 30); at 3e-4 it reached 91%
            "update": {"lr": 3e-4, "micro_batch_size": 32, "clip_eps": 0.2, "seed": seed},
            "trajectory": {"mode": "trajectory"},
        },
        "trainer": {
            "n_runners": 1,
            "max_concurrency": 64,
            "run_dir": str(run_dir.parent),
            "name": run_dir.name,
            "rollout_timeout_s": 300,
        },
    }
    path = run_dir / "train.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_seed(seed: int, out: Path, steps: int) -> dict[str, Any]:
    """Warm up, train and evaluate one seed; returns its before/after numbers."""
    import yaml

    from voltrl.cli import build_from_config
    from voltrl.runtime import free_run_name

    started = time.time()
    model_path = warm_model(seed, out / ".cache")
    warmed = time.time()
    # a re-run of a seed gets a directory of its own: the earlier run's files stay as they were
    run_dir = out / free_run_name(out, f"calculator-seed{seed}")
    config = yaml.safe_load(write_run_files(run_dir, seed, model_path, steps).read_text())
    trainer, agent, train, val = build_from_config(config)
    result = trainer.fit(agent, train, val)
    val_points = [h for h in trainer.algorithm.history if "val/reward_mean" in h]
    return {
        "seed": seed,
        "before": val_points[0]["val/reward_mean"],
        "after": val_points[-1]["val/reward_mean"],
        "warm-up minutes": (warmed - started) / 60,
        "minutes": (time.time() - warmed) / 60,
        "run_dir": str(result.run_dir),  # LocalRL left reward_curve.png there
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per seed")
    parser.add_argument("--steps", type=int, default=30, help="policy updates per seed")
    parser.add_argument(
        "--run-dir", "--out", dest="out", type=Path, default=Path("runs"),
        help="directory of run directories (and of the warm-up cache, .cache)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    started = time.time()
    results = [run_seed(seed, args.out, args.steps) for seed in args.seeds]

    from rich.console import Console
    from rich.table import Table

    table = Table(title="held-out accuracy of the calculator agent (192 tasks, sampled)")
    columns = ("seed", "after warm-up", "after LocalRL", "change", "warm-up min", "RL min", "run")
    for col in columns:
        table.add_column(col, overflow="fold")
    for r in results:
        table.add_row(
            str(r["seed"]),
            f"{r['before']:.1%}",
            f"{r['after']:.1%}",
            f"{(r['after'] - r['before']) * 100:+.1f} pts",
            f"{r['warm-up minutes']:.1f}",
            f"{r['minutes']:.1f}",
            r["run_dir"],
        )
    Console().print(table)
    print("reward curves: " + ", ".join(f"{r['run_dir']}/reward_curve.png" for r in results))
    print(f"{len(results)} seed(s) in {(time.time() - started) / 60:.1f} minutes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
