"""A run whose recorded token ids drift, for the dashboard's token-drift audit: written through
the store's API with the tiny tokenizer saved where LocalRL saves it, so prompts re-render.

Rollout ``drift``: the writer's first answer is `` a a ``; its second call sends it back
stripped (``a a``), so that call's prompt leaves its first call's prompt + response at
:data:`SPLIT_AT`; a checker's call, alone. Rollout ``altered``: one call, trained through an
explicit transition whose last token is not the sampled one (trained-token drift). Its
``metrics.jsonl`` has the reward and LocalRL's ``mismatch/*`` curves."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from voltrl.models.tiny import build_tiny_tokenizer
from voltrl.store.sql import SQLStore
from voltrl.types import AttemptResult, LLMCall, Run, Task, Transition

RUN_NAME = "drift"
SPLIT_AT = 13
"""Where the writer's second prompt leaves its first prompt + response: the first answer's
first token (`` a`` sampled, ``a`` sent back)."""
MISMATCH = (
    "mismatch/logprob_abs_mean",
    "mismatch/logprob_abs_max",
    "mismatch/kl",
    "mismatch/tokens_over",
)


@dataclass
class DriftRun:
    """What :func:`make_drift_run` wrote."""

    run_dir: Path
    run_id: str
    drift: str
    altered: str
    second_call: str


def _call(
    tok: Any, rid: str, aid: str, seq: int, agent: str, messages: list, answer: str
) -> LLMCall:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    response = [*tok.encode(answer, add_special_tokens=False), end]
    return LLMCall(
        rollout_id=rid,
        attempt_id=aid,
        sequence_id=seq,
        agent_name=agent,
        request={"model": "voltrl-local", "messages": messages},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]},
        prompt_token_ids=tok.encode(text, add_special_tokens=False),
        response_token_ids=response,
        response_logprobs=[-0.5] * len(response),
        finish_reason="stop",
        model="voltrl-local",
        resources_version=1,
        started_at=1_800_000_000.0 + seq,
        ended_at=1_800_000_000.5 + seq,
    )


async def _write(run_dir: Path, mode: str | None) -> DriftRun:
    tok = build_tiny_tokenizer()
    tok.save_pretrained(run_dir / "tokenizer")
    store = SQLStore(run_dir / "store.sqlite")
    try:
        config = {"update": {}, **({"trajectory": {"mode": mode}} if mode else {})}
        run = await store.add_run(
            Run(name=RUN_NAME, kind="fit", algorithm="local_rl", status="finished", config=config)
        )
        queued = await store.enqueue(
            [Task(task_id="say-a", input={"letter": "a"}), Task(task_id="say-b", input={})],
            run_id=run.run_id,
            resources_version=1,
        )
        ids = []
        for _ in queued:
            claim = await store.claim("worker-0", lease_s=600)
            assert claim is not None
            ids.append((claim.rollout.rollout_id, claim.attempt.attempt_id))
        (rid, aid), (other, other_aid) = ids
        user = {"role": "user", "content": "Say a."}
        first = _call(tok, rid, aid, 0, "writer", [user], " a a ")
        stripped = [
            user,
            {"role": "assistant", "content": "a a"},
            {"role": "user", "content": "Again."},
        ]
        second = _call(tok, rid, aid, 1, "writer", stripped, "a")
        checker = _call(
            tok, rid, aid, 2, "checker", [{"role": "user", "content": "Is it a?"}], "yes"
        )
        await store.add_llm_calls([first, second, checker])
        await store.complete(aid, AttemptResult(status="succeeded", reward=1.0))
        one = _call(
            tok, other, other_aid, 0, "writer", [{"role": "user", "content": "Say b."}], "b"
        )
        await store.add_llm_calls([one])
        response = [*(one.response_token_ids or [])[:-1], 7]  # not what was sampled
        altered = Transition(
            prompt_token_ids=one.prompt_token_ids or [], response_token_ids=response
        )
        await store.complete(
            other_aid, AttemptResult(status="succeeded", reward=0.0, transitions=[altered])
        )
    finally:
        await store.close()
    lines = [
        {
            "run_id": run.run_id,
            "step": step,
            "train/reward_mean": 0.5 * step,
            "update/loss": 1.0 / step,
        }
        | {name: 0.01 * step + i for i, name in enumerate(MISMATCH)}
        for step in (1, 2, 3)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return DriftRun(run_dir, run.run_id, rid, other, second.call_id)


def make_drift_run(root: Path, mode: str | None = "trajectory") -> DriftRun:
    """Write the run into ``root/drift/``, recorded as trained with ``trajectory.mode``
    ``mode`` (None: with no trajectory settings, as a dev run records)."""
    run_dir = root / RUN_NAME
    run_dir.mkdir(parents=True)
    return asyncio.run(_write(run_dir, mode))
