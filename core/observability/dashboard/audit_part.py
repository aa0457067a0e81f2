"""The run page's token-drift audit: a part fetched once the page has loaded.

``/runs/{run_id}/audit`` audits every rollout of the run (:mod:`voltrl.observability.audit_views`,
with the run's tokenizer) and answers the summary: calls audited, identical, diverging, not
checkable by reason; continuations merged and split; trained-token drift; per agent; the first
diverging calls, each a link to its rollout, where its token view marks the position. The page
itself never waits for it. An audit is kept per run and per count of its rollouts by status
(:data:`AUDITS_KEPT` of them): a finished run is audited once, a running one again only when a
rollout has finished since.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from voltrl.observability.audit_views import audit_rollouts, trajectory_settings
from voltrl.observability.dashboard import data
from voltrl.trajectory.audit import AuditSummary, summarize

AUDITS_KEPT = 16
"""Runs whose audit is kept (the most recently shown)."""
SHOWN = 10
"""Diverging calls the part lists."""


@dataclass
class RunAuditPart:
    """What the part shows: the summary, how the prompts were re-rendered, how long it took,
    and the ``trajectory.mode`` the run trained with (in transition mode a split continuation
    costs nothing: every call trains as its own row); None for a run that recorded none (a
    dev run, a prompt search: it trains no rows)."""

    summary: AuditSummary
    tokenizer_note: str
    seconds: float
    mode: str | None


_AUDITS: OrderedDict[tuple[str, tuple[Any, ...]], RunAuditPart] = OrderedDict()


def add_audit_part(app: FastAPI, catalog: data.Catalog, page: Callable[..., HTMLResponse]) -> None:
    """Route the run page's audit part on ``app``."""

    @app.get("/runs/{run_id}/audit", response_class=HTMLResponse, name="run_audit")
    async def run_audit(request: Request, run_id: str) -> HTMLResponse:
        entry = await catalog.run(run_id)
        found = await run_audit_of(entry)
        return page(request, "audit.html", entry=entry, audit=found, shown=SHOWN)


async def run_audit_of(entry: data.RunEntry) -> RunAuditPart:
    """The run's audit, from the cache while no rollout of it changed status."""
    counts = await entry.store.rollout_counts(entry.run.run_id)
    stamp = tuple(sorted((c.mode, c.status, c.resources_version or 0, c.count) for c in counts))
    key = (entry.run.run_id, stamp)
    kept = _AUDITS.get(key)
    if kept is not None:
        _AUDITS.move_to_end(key)
        return kept
    loop = asyncio.get_running_loop()
    start = loop.time()
    tokenizer, note = await asyncio.to_thread(data.load_tokenizer, entry)
    path, _ = data.tokenizer_dir(entry)
    if tokenizer is None:
        note = f"{note}; the template checks are not checkable"
    else:
        note = f"prompts re-rendered with the tokenizer in {path}"
    rollouts = await entry.store.query_rollouts(run_id=entry.run.run_id)
    settings = trajectory_settings(entry.run)
    audits = await audit_rollouts(entry.store, rollouts, tokenizer, settings)
    mode = settings.mode if "trajectory" in entry.run.config else None
    found = RunAuditPart(summarize(audits), note, loop.time() - start, mode)
    data.keep_newest(_AUDITS, key, found, AUDITS_KEPT)
    return found
