"""The CPU learning recipe every framework sample shares: teacher → SFT → RL, measured.

1. **Teacher.** The sample's agent, unchanged, runs its teacher tasks with ``dev`` against a
   scripted teacher (``samples/teacher_server.py`` + the sample's ``teacher.py``: an imperfect
   player, answering like a hosted API, without token ids; VoltRL's teacher server,
   :mod:`voltrl.serving.teacher`). The real framework renders every prompt and the gateway
   records every call into ``runs/<sample>-teacher<seed>-<key>/``.
   Recorded once per teacher configuration (tasks, teacher seed, teacher code) and reused by
   every seed.
2. **SFT.** A tiny model built from scratch (random weights, the built-in tokenizer; saved
   once under ``runs/.cache`` so that the run's ``train.yaml`` names it by path) is
   fine-tuned on the teacher's rollouts (``vl.SFT(source=teacher runs, retokenize=True)``:
   re-tokenised with the student's chat template). All of them, mistakes included: the student
   learns the framework's conversation, the tool-call format and the task's skills, and inherits
   the teacher's habits, good and bad, at the teacher's rates; ``min_reward=1.0`` (rejection
   sampling) would keep only the good episodes.
3. **RL.** ``vl.LocalRL(..., warm_start=that SFT)`` in one ``fit``: validation before the first
   update measures the student after warm-up, the last one after RL, on held-out tasks the
   student never trained on, sampled as in training (temperature 1). The recipes run each
   held-out task twice (``validation.n`` 2): one sampled rollout of each of 128 tasks moves the
   figure by about ±4 points from one validation to the next, and a seed's gain is the
   difference of two such figures.

:func:`run_recipe` runs one seed and returns its row of the learning table
(``benchmarks/learning.py`` prints the table for every sample and seed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import voltrl as vl
from voltrl.runtime import free_run_name

HERE = Path(__file__).resolve().parent

Rows = list[dict[str, Any]]


@dataclass
class Recipe:
    """One sample's recipe: its agent, tasks, teacher and the settings of each phase."""

    sample: str
    """The sample's directory name (``autogen_calc``): its ``teacher.py`` is the teacher."""
    framework: str
    agent: Any
    """The sample's agent, as its ``run.py`` passes it to the trainer."""
    tasks: Callable[[int], tuple[Rows, Rows, Rows]]
    """``seed → (teacher tasks, training tasks, held-out tasks)``; held-out tasks appear in
    neither of the others."""
    sft: dict[str, Any]
    """``vl.SFT`` arguments (steps, lr, batch_size, min_reward, agents...)."""
    rl: dict[str, Any]
    """``vl.LocalRL`` arguments (schedule, sampling, validation, update, trajectory...)."""
    credit: str
    """Which credit mode the RL phase uses, and why (for the table's notes)."""
    model: dict[str, Any] | str = field(default_factory=lambda: {"hidden": 128, "layers": 2})
    """The student: a tiny model's size (``build_tiny_model`` arguments), or a model name
    ``LocalRL`` loads (``"smollm2-135m-instruct"``: a pretrained model, fetched once)."""
    teacher_seeds: tuple[int, ...] = (0,)
    """One teacher run per seed (the teacher errs differently with each); SFT uses them all."""
    concurrency: int = 32
    agent_in: Callable[[Path], contextlib.AbstractContextManager[Any]] | None = None
    """When set, ``agent_in(run_dir)`` yields the agent for the run instead of ``agent``
    (``agent_service`` starts its service here, ``calc_mcp`` its one MCP server)."""
    simplified: str = ""
    """How the CPU recipe's tasks differ from the sample's own (empty: they don't)."""
    variant: str = ""
    """Which of the sample's recipes this is, when it has several (``werewolf``: the side
    trained): in the run names and the learning table (``werewolf-wolves``)."""
    resources_in: Callable[[int], contextlib.AbstractContextManager[dict[str, Any]]] | None = None
    """When set, ``resources_in(seed)`` yields the trainer's ``resources`` for the RL run
    (``werewolf`` serves its scripted teacher there, as the side not trained)."""
    measure: Callable[[Any, list[dict[str, Any]]], dict[str, Any]] | None = None
    """When set, ``measure(run result, LocalRL's history)`` gives more fields for the seed's
    row (``werewolf``: win rates with their intervals, the test between them, legal answers)."""
    table_lines: Callable[[list[dict[str, Any]]], list[str]] | None = None
    """When set, the lines ``benchmarks/learning.py`` prints and writes for this recipe's rows
    after the learning table (``werewolf``: the figures ``measure`` added)."""


SMOLLM2_SFT = {
    "steps": 24,
    "batch_size": 16,
    "micro_batch_size": 8,
    "lr": 1e-4,
    "warmup_steps": 4,
    "threads": 2,
}
"""The warm-up of the framework samples' SmolLM2 recipes, as the calculator's, but in
micro-batches of 8 rows (the same gradient): 16 rows of ~350 tokens took a process to 13.6 GB
and the out-of-memory killer on a machine shared with other runs."""


def smollm2(recipe: Recipe, tasks: Callable[[int], tuple[Rows, Rows, Rows]]) -> Recipe:
    """``recipe`` on SmolLM2-135M-Instruct, as the calculator's SmolLM2 recipe trains it: the
    sample's ``tasks``, a warm-up of every weight (:data:`SMOLLM2_SFT`), then 12 LoRA updates
    of 8 tasks x 8, sampled at temperature 1 with replies up to 64 tokens (each sample's
    longest teacher reply is under 50 with SmolLM2's tokenizer), each held-out task validated
    once, 64 rollouts at a time."""
    sampling = {"temperature": 1.0, "max_tokens": 64}
    return dataclasses.replace(
        recipe,
        model="smollm2-135m-instruct",
        tasks=tasks,
        sft=SMOLLM2_SFT,
        rl={
            "schedule": {"steps": 12, "tasks_per_step": 8, "group_size": 8},
            "validation": {"sampling": sampling, "every": 12, "n": 1},
            "compute": {"threads": 2},
            "sampling": sampling,
            "update": {"use_lora": True, "lr": 2e-4, "micro_batch_size": 8, "clip_eps": 0.2},
            "trajectory": {"mode": "trajectory"},
        },
        concurrency=64,
    )


def word_problem_sets(
    make_problems: Callable[..., Rows], seed: int, n_teacher: int, max_number: int | None
) -> tuple[Rows, Rows, Rows]:
    """A calculator sample's task sets: ``n_teacher`` teacher problems (fixed), 2,000 training
    problems (by ``seed``) and 128 held-out problems (fixed), the held-out questions in neither
    of the others; every number drawn up to ``max_number``."""
    val = make_problems(128, seed=999_999, max_number=max_number)
    held_out = {row["question"] for row in val}
    teacher = make_problems(n_teacher, seed=777, max_number=max_number)
    train = make_problems(2000, seed=seed, max_number=max_number)
    return (
        [r for r in teacher if r["question"] not in held_out],
        [r for r in train if r["question"] not in held_out],
        val,
    )


def record_teacher(recipe: Recipe, out: Path, seed: int) -> Path:
    """The teacher's ``dev`` run directory for teacher seed ``seed``, recorded now unless an
    identical one exists (same tasks, seed, teacher and agent code)."""
    from teacher_server import load_sample_teacher

    from voltrl.serving import teacher as teacher_server

    tasks, _, _ = recipe.tasks(0)
    code = [  # the teacher, its server and the agent: a change to any records again
        Path(teacher_server.__file__),
        HERE / "teacher_server.py",
        *sorted(p for p in (HERE / recipe.sample).glob("*.py") if p.name != "recipe.py"),
    ]
    key = hashlib.sha1(
        json.dumps([tasks, seed], sort_keys=True, default=str).encode()
        + b"".join(p.read_bytes() for p in code)
    ).hexdigest()[:10]
    run_dir = out / f"{label(recipe)}-teacher{seed}-{key}"
    if (run_dir / "teacher.done").exists():
        print(f"teacher: using the recorded run {run_dir}", flush=True)
        return run_dir
    if run_dir.exists():  # an interrupted recording: start it again
        shutil.rmtree(run_dir)
    with (
        teacher_server.serve_teacher(load_sample_teacher(recipe.sample), seed=seed) as url,
        _agent(recipe, run_dir) as agent,
    ):
        trainer = vl.Trainer(
            resources={"main_llm": vl.LLM(endpoint=url, model="teacher")},
            request_token_ids=False,  # like a hosted API: the student re-tokenises
            n_runners=1,
            max_concurrency=recipe.concurrency,
            run_dir=out,
            name=run_dir.name,
        )
        result = trainer.dev(agent, tasks)
    solved = result.stats.reward_mean or 0.0
    print(f"teacher: solved {solved:.1%} of {len(tasks)} tasks; run in {result.run_dir}")
    (run_dir / "teacher.done").write_text(json.dumps({"solved": solved, "tasks": len(tasks)}))
    return run_dir


@contextlib.contextmanager
def _agent(recipe: Recipe, run_dir: Path) -> Iterator[Any]:
    if recipe.agent_in is None:
        yield recipe.agent
    else:
        with recipe.agent_in(run_dir) as agent:
            yield agent


def label(recipe: Recipe) -> str:
    """The recipe's name in run names and the learning table: the sample, and its variant if
    it has one (``werewolf-wolves``)."""
    return f"{recipe.sample}-{recipe.variant}" if recipe.variant else recipe.sample


def student(recipe: Recipe, seed: int, cache: Path = Path("runs") / ".cache") -> dict[str, Any]:
    """LocalRL's (or SFT's) ``model`` keyword: the model ``recipe.model`` names, or a tiny
    model with random weights (``recipe.model``'s size, ``seed``'s weights), saved once under
    ``cache`` and named by its path, so the run's ``train.yaml`` loads it again."""
    from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer

    if isinstance(recipe.model, str):
        return {"model": recipe.model}
    size = "-".join(f"{k}{v}" for k, v in sorted(recipe.model.items()))
    path = (cache / f"tiny-{size}-seed{seed}").resolve()
    if not (path / "config.json").exists():
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_model(tokenizer, seed=seed, **recipe.model)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with contextlib.suppress(OSError):  # another process saved the same model first
            tmp.rename(path)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"model": str(path)}


def warm_up(
    recipe: Recipe, seed: int, out: Path, *, steps: int | None = None, threads: int | None = None
) -> tuple[Path, float]:
    """The seed's warm-up alone (``vl.SFT`` on the recorded teacher runs, as the recipe's
    ``fit`` does before RL; ``steps``, ``threads``: other than the recipe's), for benchmarks
    that start several RL runs from it: saved to ``<out>/<label>-warm-seed<seed>-<key>/final``
    and reused while the student, the SFT settings and the teacher's runs are the same.
    Returns that directory and the minutes it took (0 when reused)."""
    teachers = [record_teacher(recipe, out, s).resolve() for s in recipe.teacher_seeds]
    sft = {**recipe.sft, **({"steps": steps} if steps else {})}
    if threads:
        sft["threads"] = threads
    model = student(recipe, seed, out / ".cache")
    key = hashlib.sha1(
        json.dumps([model, sft, [t.name for t in teachers]], sort_keys=True, default=str).encode()
    ).hexdigest()[:10]
    name = f"{label(recipe)}-warm-seed{seed}-{key}"
    final = out / name / "final"
    if (final / "config.json").exists():
        print(f"warm-up: using {final}", flush=True)
        return final, 0.0
    started = time.time()
    algorithm = vl.SFT(**model, source=teachers, retokenize=True, seed=seed, **sft)
    vl.Trainer(algorithm, run_dir=out, name=name).fit(recipe.agent, [{}])
    return final, (time.time() - started) / 60


def recipe_key(recipe: Recipe) -> str:
    """A digest of a recipe's settings (the student, each phase's, the teacher's seeds): rows
    of the learning table measured with other settings are not mixed with these."""
    settings = [recipe.model, recipe.sft, recipe.rl, recipe.teacher_seeds, recipe.concurrency]
    return hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:10]


def run_recipe(recipe: Recipe, seed: int, out: Path = Path("runs")) -> dict[str, Any]:
    """Teacher (cached), then SFT and LocalRL in one ``fit``; the seed's row of the table."""
    # absolute paths: the run's train.yaml runs it again from any directory
    teacher_dirs = [record_teacher(recipe, out, s).resolve() for s in recipe.teacher_seeds]
    _, train, val = recipe.tasks(seed)
    sft = vl.SFT(source=teacher_dirs, retokenize=True, seed=seed, **recipe.sft)
    model = student(recipe, seed, out / ".cache")
    algorithm = vl.LocalRL(**model, warm_start=sft, seed=seed, **recipe.rl)
    # the trainer would name it the same; known now, the agent's side files go there too
    which = "recipe" if isinstance(recipe.model, dict) else recipe.model
    name = free_run_name(out, f"{label(recipe)}-{which}-seed{seed}")
    started = time.time()
    resources = recipe.resources_in(seed) if recipe.resources_in else contextlib.nullcontext()
    with _agent(recipe, out / name) as agent, resources as extra:
        trainer = vl.Trainer(
            algorithm,
            n_runners=1,
            max_concurrency=recipe.concurrency,
            run_dir=out,
            name=name,
            resources=extra,
        )
        result = trainer.fit(agent, train, val)
    minutes = (time.time() - started) / 60
    history = algorithm.history
    val_points = [(h["step"], h["val/reward_mean"]) for h in history if "val/reward_mean" in h]
    steps = [h for h in history if "train/reward_mean" in h]
    merged = sum(h.get("batch/merged", 0) for h in steps)
    failures = sum(h.get("batch/merge_failures", 0) for h in steps)
    row = {
        "sample": recipe.sample,
        **({"variant": recipe.variant} if recipe.variant else {}),
        "framework": recipe.framework,
        "model": recipe.model if isinstance(recipe.model, str) else "tiny",
        "recipe": recipe_key(recipe),
        "seed": seed,
        "after_sft": val_points[0][1] if val_points else None,
        "after_rl": val_points[-1][1] if val_points else None,
        "val_curve": val_points,
        "train_curve": [(h["step"], h["train/reward_mean"]) for h in steps],
        "minutes": minutes,
        "merge_rate": merged / (merged + failures) if merged + failures else None,
        "sft_tokens": sft.summary.get("tokens", 0),
        "sft_rows": sft.summary.get("rows", 0),
        "sft_merge_failures": sft.summary.get("merge_failures", 0),
        "rl_tokens": sum(h.get("update/adv_tokens", 0) for h in steps),
        "credit": recipe.credit,
        "run_dir": str(result.run_dir),
        "teacher_solved": [json.loads((d / "teacher.done").read_text()) for d in teacher_dirs],
    }
    if recipe.measure is not None:
        row |= recipe.measure(result, history)
    (Path(result.run_dir) / "recipe.json").write_text(json.dumps(row, indent=1))
    return row
