"""A run's token-drift audit, loaded: every rollout's final attempt audited with the run's
tokenizer and summed (``voltrl audit``; the dashboard's run page and call token views).

The audit itself is :mod:`voltrl.trajectory.audit`'s; this module reads what it needs from a
run's store (found by :func:`~.run_views.find_run`), finds the tokenizer LocalRL saved in the run
directory (:mod:`.tokenizers`), and turns the result into JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from voltrl.errors import VoltRLError
from voltrl.observability.run_views import Found, run_directory
from voltrl.observability.tokenizers import load_saved_tokenizer, saved_tokenizer
from voltrl.store.base import Store
from voltrl.trajectory import TrajectoryConfig
from voltrl.trajectory.audit import AuditSummary, RolloutAudit, audit_calls, summarize
from voltrl.types import LLMCall, Rollout, Run

TRAINED_MODES = ("train", "dev")
"""The modes of rollouts a builder may train (LocalRL's train rollouts; SFT takes ``dev`` ones
too): the others (validation, an algorithm's own calls) have no trained-token drift."""
AT_ONCE = 16
"""Rollouts whose records are read at the same time."""


@dataclass
class RunAudit:
    """A run's audit: each rollout with its audit (in the store's order), their sum, and
    which tokenizer re-rendered the prompts (or why none did)."""

    run: Run
    where: str
    tokenizer_note: str
    rollouts: list[tuple[Rollout, RolloutAudit]]
    summary: AuditSummary


def recorded_trajectory(run: Run) -> TrajectoryConfig:
    """The trajectory settings the run recorded (LocalRL's and SFT's ``trajectory``), which
    decide what its builder trains (the defaults when it recorded none), for the tools that
    rebuild its rows or audit them: a run that re-tokenized calls recorded no retokenizer, so
    one that refuses to run stands in; settings this version does not know are left out.
    Raises ``ValueError`` for values it does not take (a run of another VoltRL version)."""
    settings = run.config.get("trajectory")
    fields = TrajectoryConfig.model_fields
    given = settings if isinstance(settings, dict) else {}
    known = {k: v for k, v in given.items() if k in fields}
    if known.get("missing_token_ids") == "retokenize":
        known["retokenizer"] = _not_here
    return TrajectoryConfig(**known)


def trajectory_settings(run: Run) -> TrajectoryConfig:
    """:func:`recorded_trajectory`, or the defaults when this version does not take them:
    what the audit checks the trained rows against."""
    try:
        return recorded_trajectory(run)
    except ValueError:  # settings of another version: what it trains is then the default
        return TrajectoryConfig()


def _not_here(call: LLMCall) -> tuple[list[int], list[int]]:
    raise VoltRLError("the run's retokenizer is not recorded: this view re-tokenizes no call")


def run_tokenizer(run_dir: Path | None, given: str | Path | None = None) -> tuple[Any, str]:
    """The tokenizer to audit with: ``given`` (a path, a hub or packaged name, ``"tiny"``),
    else the one LocalRL saved in ``run_dir``; None and why when there is none (template
    checks are then not checkable)."""
    if given is not None:
        from voltrl.models.loading import load_tokenizer

        return load_tokenizer(given), f"the tokenizer of {given}"
    path = saved_tokenizer(run_dir)
    if path is None:
        where = run_dir if run_dir is not None else "the run directory (not known here)"
        return None, (
            f"no tokenizer saved in {where}: the template checks are not checkable (give a "
            "tokenizer: voltrl audit --tokenizer)"
        )
    return load_saved_tokenizer(path), f"the run's tokenizer in {path}"


async def audit_rollouts(
    store: Store,
    rollouts: Sequence[Rollout],
    tokenizer: Any,
    config: TrajectoryConfig,
    *,
    on_done: Callable[[int], None] | None = None,
) -> list[RolloutAudit]:
    """Audit each rollout's final attempt (else its last, as the builder picks it), in the
    order given; ``on_done(n)`` after each, with how many are done. The checks run on a
    thread (a chat template renders slowly)."""
    done = 0
    gate = asyncio.Semaphore(AT_ONCE)

    async def one(rollout: Rollout) -> RolloutAudit:
        nonlocal done
        async with gate:
            rid = rollout.rollout_id
            attempts = await store.get_attempts(rid)
            attempt = next(
                (a for a in attempts if a.attempt_id == rollout.final_attempt_id),
                attempts[-1] if attempts else None,
            )
            calls = await store.get_llm_calls(rid, attempt.attempt_id) if attempt else []
            audit = await asyncio.to_thread(
                audit_calls,
                calls,
                tokenizer,
                transitions=attempt.transitions if attempt else None,
                config=config,
                rollout_id=rid,
                trains=rollout.mode in TRAINED_MODES,
            )
        done += 1
        if on_done is not None:
            on_done(done)
        return audit

    return list(await asyncio.gather(*(one(r) for r in rollouts)))


async def audit_run(
    found: Found,
    *,
    run_dir: str | Path = "runs",
    tokenizer: str | Path | None = None,
    on_start: Callable[[int], None] | None = None,
    on_done: Callable[[int], None] | None = None,
) -> RunAudit:
    """Audit every rollout of ``found``'s run with ``tokenizer`` (see :func:`run_tokenizer`;
    default: the run's own, from its directory, found beside its SQLite store or in
    ``run_dir``). ``on_start(n)`` is told how many rollouts there are, ``on_done(k)`` how
    many are done."""
    loaded, note = await asyncio.to_thread(run_tokenizer, run_directory(found, run_dir), tokenizer)
    rollouts = await found.store.query_rollouts(run_id=found.run.run_id)
    if on_start is not None:
        on_start(len(rollouts))
    config = trajectory_settings(found.run)
    audits = await audit_rollouts(found.store, rollouts, loaded, config, on_done=on_done)
    return RunAudit(
        found.run, found.where, note, list(zip(rollouts, audits, strict=True)), summarize(audits)
    )


def as_json(audit: RunAudit) -> dict[str, Any]:
    """The whole audit as JSON-ready data: the run, the summary (totals, per agent), and
    every rollout with each call's checks and its trained-token drift."""
    summary = audit.summary
    return {
        "run": {"run_id": audit.run.run_id, "name": audit.run.name, "store": audit.where},
        "tokenizer": audit.tokenizer_note,
        "summary": {**summary.counts.as_dict(), "rollouts": summary.rollouts},
        "agents": {name: counts.as_dict() for name, counts in summary.agents.items()},
        "trained_drift": [dataclasses.asdict(d) for d in summary.trained_drift],
        "rollouts": [
            {
                "rollout_id": rollout.rollout_id,
                "mode": rollout.mode,
                "attempt_id": found.attempt_id,
                "counts": found.counts.as_dict(),
                "calls": [
                    {**dataclasses.asdict(call), "outcome": call.outcome} for call in found.calls
                ],
                "trained_drift": [dataclasses.asdict(d) for d in found.trained_drift],
            }
            for rollout, found in audit.rollouts
        ],
    }
