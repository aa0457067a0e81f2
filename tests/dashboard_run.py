"""A real short LocalRL run for the dashboard's tests: two agents, a tool span, rewards, a
failed attempt that is retried, validation; recorded in ``<dir>/dash/``.

With ``DASHBOARD_RUN_GATE`` set to a path, every rollout waits until that file exists: a test
sees the run started, then lets it go on (the browser test reads a page of the running run
first, then opens the gate and waits for the page to show the steps that follow)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from openai import AsyncOpenAI

import voltrl as vl
from voltrl.algorithms.local.update import PolicyUpdateConfig
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.trajectory import TrajectoryConfig

RUN_NAME = "dash"
GATE = "DASHBOARD_RUN_GATE"
ROWS = [{"letter": c, "n": i} for i, c in enumerate("abcd")]
_failed_once: set[str] = set()


@vl.rollout
async def writer_checker(task: dict, llm: vl.LLM) -> float:
    """Two writer calls (one conversation: trajectory mode merges them, the user's second
    turn fed in with mask 0), a tool span, a checker call, a ``verdict`` event; the first try
    of task ``d`` raises.

    The writer's first reply is greedy: an untrained model sampled at temperature 1 often
    ends a reply inside a multi-byte UTF-8 character, whose text (with U+FFFD) re-tokenizes
    to other ids when the conversation is sent back, and such turns do not merge (about 5
    in 6 did). Greedy, the first step's replies are the same every run, and merge."""
    gate = os.environ.get(GATE)
    while gate and not Path(gate).exists():  # the test opens it (see the module docstring)
        await asyncio.sleep(0.05)
    writer = llm.for_agent("writer")
    client = AsyncOpenAI(base_url=writer.endpoint, api_key=llm.api_key, max_retries=0)
    messages = [{"role": "user", "content": f"Say {task['letter']}."}]
    for follow_up in ("Again.", None):
        sampling = {**llm.sampling_parameters, **({"temperature": 0} if follow_up else {})}
        answer = await client.chat.completions.create(
            model=llm.model, messages=messages, **sampling
        )
        text = answer.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    with vl.span("tool.lookup", letter=task["letter"]):
        found = task["letter"] in text
    vl.emit_reward(0.5 if found else 0.0, name="found", agents="writer")
    if task["letter"] == "d" and vl.current_rollout().rollout_id not in _failed_once:
        _failed_once.add(vl.current_rollout().rollout_id)
        raise RuntimeError("the checker tool is down (a test failure, retried)")
    checker = llm.for_agent("checker")
    client = AsyncOpenAI(base_url=checker.endpoint, api_key=llm.api_key, max_retries=0)
    question = [{"role": "user", "content": f"Does {text!r} say {task['letter']}?"}]
    second = await client.chat.completions.create(
        model=llm.model, messages=question, **llm.sampling_parameters
    )
    said = second.choices[0].message.content or ""
    vl.emit_event("verdict", letter=task["letter"], found=found, checked=task["letter"] in said)
    return float(task["letter"] in said) + 0.5 * found


def make_run(run_dir: Path, *, steps: int = 2, name: str = RUN_NAME) -> vl.LocalRL:
    """Train a tiny model for ``steps`` steps; returns the algorithm (its history)."""
    tok = build_tiny_tokenizer()
    algorithm = vl.LocalRL(
        build_tiny_model(tok, seed=0),
        tokenizer=tok,
        schedule={"steps": steps, "tasks_per_step": 2, "group_size": 3},
        validation={"every": steps, "sampling": {"max_tokens": 6}},
        sampling={"temperature": 1.0, "max_tokens": 6},
        update=PolicyUpdateConfig(lr=1e-3, micro_batch_size=8),
        trajectory=TrajectoryConfig(mode="trajectory"),
    )
    trainer = vl.Trainer(
        algorithm, n_runners=1, max_concurrency=6, run_dir=run_dir, name=name, progress=False
    )
    trainer.fit(writer_checker, ROWS, val_dataset=ROWS[:2])
    return algorithm


if __name__ == "__main__":  # the browser test trains one while the dashboard is open
    import sys

    make_run(Path(sys.argv[1]), steps=int(sys.argv[2]), name=sys.argv[3])
