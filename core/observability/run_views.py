"""Finding a run, and loading what ``voltrl show`` shows of it.

:func:`find_run` finds a run by id, name or run directory in a store or in the stores of a
directory of run directories; :func:`load_run` loads its rollouts, ``metrics.jsonl`` and an APO
run's candidates (a :class:`RunView`); :func:`load_rollout` one rollout with its attempts, calls,
rewards and spans (a :class:`RolloutView`); :func:`run_directory` where its files are. Rendering
is :mod:`.show`'s.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from voltrl.errors import NotFoundError, StoreError, VoltRLError
from voltrl.observability import prompt_search
from voltrl.observability.metrics import read_metrics
from voltrl.observability.prompt_search import PromptSearch
from voltrl.store.base import Store
from voltrl.store.spec import parse_store
from voltrl.types import Attempt, LLMCall, Reward, Rollout, Run, Span


@dataclass
class Found:
    """A run found in a store: the open store, the run, the store's spec and SQLite file
    (None for PostgreSQL or a server), and a note when several runs had its name."""

    store: Store
    run: Run
    where: str
    """The store's spec, a URL's password hidden."""
    path: Path | None
    note: str | None = None
    asked: str = ""
    """The ``RUN`` it was found by (a name, an id or a run directory)."""


@dataclass
class RunView:
    """What ``voltrl show RUN`` prints; ``metrics`` is None without a ``metrics.jsonl``."""

    found: Found
    rollouts: list[Rollout]
    metrics: list[dict[str, Any]] | None = None
    metrics_path: Path | None = None
    search: PromptSearch | None = None
    """An APO run's candidates (``prompt_search.json`` beside its metrics)."""


@dataclass
class RolloutView:
    """What ``voltrl show RUN ROLLOUT_ID`` prints."""

    found: Found
    rollout: Rollout
    attempts: list[Attempt]
    calls: list[LLMCall]
    rewards: list[Reward]
    spans: list[Span]


async def find_run(
    run: str, *, store: str | None = None, run_dir: str | Path = "runs", token: str | None = None
) -> Found:
    """The run with the id or name ``run`` in ``store``, else in the stores of ``run_dir``:
    the latest of several of that name, with a note saying so. ``run`` may also be a run
    directory (one holding ``store.sqlite``): the run named like it, in its own store."""
    asked = run
    if store is None and (Path(run) / "store.sqlite").is_file():
        store, run = str(Path(run) / "store.sqlite"), Path(run).resolve().name
    specs = [store] if store else [str(p) for p in sorted(Path(run_dir).glob("*/store.sqlite"))]
    seen: list[tuple[str, Run]] = []
    unreadable: list[str] = []  # stores of run_dir that cannot be read (another version's)
    for spec in specs:
        try:
            opened = parse_store(spec, token=token, existing=True).open(retries=2, read_only=True)
        except StoreError as e:
            if store:
                raise
            unreadable.append(str(e))
            continue
        try:
            seen += [(spec, r) for r in await opened.list_runs()]
        finally:
            await opened.close()
    matches = [s for s in seen if s[1].run_id == run] or [s for s in seen if s[1].name == run]
    if not matches:
        names = ", ".join(f"{r.name} ({r.run_id})" for _, r in seen[-15:])
        more = f" and {len(seen) - 15} more" if len(seen) > 15 else ""
        there = f"runs there: {names}{more}" if seen else "there are no runs there"
        skipped = f"; not read: {'; '.join(unreadable)}" if unreadable else ""
        raise VoltRLError(f"no run {run!r} in {store or run_dir}; {there}{skipped}")
    spec, chosen = max(matches, key=lambda s: s[1].created_at)
    note = None
    if len(matches) > 1:
        others = ", ".join(r.run_id for _, r in matches if r is not chosen)
        note = (
            f"{len(matches)} runs are named {run!r}: showing the latest, {chosen.run_id} "
            f"(started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(chosen.created_at))}); "
            f"the others: {others}"
        )
    where = parse_store(spec, token=token, existing=True)
    return Found(
        where.open(retries=2, read_only=True),
        chosen,
        where.describe(),
        where.sqlite_file,
        note,
        asked,
    )


def run_directory(found: Found, run_dir: str | Path = "runs") -> Path | None:
    """The run's directory (its ``metrics.jsonl``, its saved tokenizer): its SQLite store's
    own (``runs/NAME/store.sqlite``) or a sibling of the run's name, else ``run_dir/NAME``;
    None when none is found (a store server, PostgreSQL)."""
    name = found.run.name
    candidates = [Path(run_dir) / name]
    if found.path is not None:
        own = found.path.parent
        candidates[:0] = [own] if own.name == name else [own / name, own]
    for candidate in candidates:
        if any((candidate / f).exists() for f in ("metrics.jsonl", "store.sqlite", "tokenizer")):
            return candidate
    return None


async def load_run(found: Found, run_dir: str | Path = "runs") -> RunView:
    """The run's rollouts and its lines of ``metrics.jsonl``, found beside its SQLite store
    or in ``run_dir/<name>/``."""
    run = found.run
    view = RunView(found, await found.store.query_rollouts(run_id=run.run_id))
    candidates = [Path(run_dir) / run.name / "metrics.jsonl"]
    if found.path is not None:
        candidates.insert(0, found.path.parent / "metrics.jsonl")
    for path in candidates:
        records = read_metrics(path, run.run_id) if path.is_file() else []
        if records or path.is_file():
            view.metrics, view.metrics_path = records or None, path
        if records:
            break
    if view.metrics_path is not None:
        view.search = prompt_search.load(view.metrics_path.parent)
    return view


async def load_rollout(found: Found, rollout_id: str) -> RolloutView:
    """One rollout of the run (its id, or a unique prefix of one) with its attempts, LLM
    calls, rewards and spans."""
    store, run = found.store, found.run
    try:
        rollout: Rollout | None = await store.get_rollout(rollout_id)
    except NotFoundError:
        rollout = None
    if rollout is None or rollout.run_id != run.run_id:
        ids = [r.rollout_id for r in await store.query_rollouts(run_id=run.run_id)]
        hits = [i for i in ids if i.startswith(rollout_id)]
        if len(hits) > 1:
            shown = ", ".join(hits[:5]) + (", ..." if len(hits) > 5 else "")
            raise VoltRLError(
                f"rollout id prefix {rollout_id!r} matches {len(hits)} rollouts of run "
                f"{run.name}: {shown}; give more of the id"
            )
        if not hits:
            other = f" (it is a rollout of run {rollout.run_id})" if rollout else ""
            raise VoltRLError(
                f"no rollout {rollout_id!r} in run {run.name} ({run.run_id}){other}; "
                f"it has {len(ids)} rollouts" + (f", e.g. {ids[-1]}" if ids else "")
            )
        rollout = await store.get_rollout(hits[0])
    rid = rollout.rollout_id
    records = [store.get_attempts(rid), store.get_llm_calls(rid), store.get_rewards(rid)]
    return RolloutView(found, rollout, *await asyncio.gather(*records, store.get_spans(rid)))
