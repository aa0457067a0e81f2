"""What the dashboard shows, read from the stores and run directories it was given.

Plain data for the templates: no HTML here. :class:`Catalog` finds runs in any number of stores
(run directories, store files, store servers, PostgreSQL); the other functions read one run's
metrics, decode token ids with the run's tokenizer, rebuild the training rows of a rollout and
the advantages LocalRL gave them, and lay out spans as a tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from voltrl.errors import NotFoundError, StoreError, VoltRLError
from voltrl.store import open_store
from voltrl.store.base import Store
from voltrl.store.browse import RolloutQuery
from voltrl.types import LLMCall, Rollout, Run, Span

STORE_FILE = "store.sqlite"
METRICS_FILE = "metrics.jsonl"
TOKENIZER_DIRS = ("tokenizer", "final")  # LocalRL saves the first at setup, the second at the end


@dataclass
class RunEntry:
    """A run, the store holding it, and its run directory when known (metrics, tokenizer)."""

    run: Run
    store: Store
    where: str
    run_dir: Path | None


@dataclass
class _Source:
    spec: str
    root: Path | None = None  # a directory of run directories, scanned for new ones
    stores: dict[str, Store] = field(default_factory=dict)  # location -> store


class Catalog:
    """The stores the dashboard reads: each source is a directory of run directories
    (``runs/``, scanned again on every listing, so new runs appear), a run directory, a store
    file, or a store URL (``http://``, ``postgresql://``). A store server's token comes from
    ``token`` (else ``$VOLTRL_TOKEN``, as :func:`~voltrl.store.open_store` reads it)."""

    def __init__(self, sources: Sequence[str | Path | Store], *, token: str | None = None) -> None:
        if not sources:
            raise VoltRLError("the dashboard needs a store: a run directory, a file or a URL")
        self._token = token
        self._sources = [self._source(s) for s in sources]
        self._owned = [not isinstance(s, Store) for s in sources]
        self._runs: dict[str, RunEntry] = {}

    def _source(self, source: str | Path | Store) -> _Source:
        if isinstance(source, Store):  # a store open elsewhere (voltrl serve's), not closed here
            location = str(getattr(source, "location", type(source).__name__))
            return _Source(location, stores={location: source})
        spec = str(source)
        if "://" in spec and not spec.startswith("sqlite:"):
            return _Source(spec, stores={spec: self._open(spec)})
        path = Path(spec).expanduser()
        if path.is_dir() and not (path / STORE_FILE).exists():
            return _Source(spec, root=path)
        if path.is_dir():
            path = path / STORE_FILE
        if not path.exists():
            raise VoltRLError(
                f"no store at {spec}: expected a run directory, a directory of them, "
                "a store file or a store URL"
            )
        return _Source(spec, stores={str(path): self._open(str(path))})

    def _open(self, spec: str) -> Store:
        if spec.startswith(("http://", "https://")) and self._token:
            from voltrl.store.client import HTTPStore

            return HTTPStore(spec, token=self._token)
        return open_store(spec)

    def _scan(self) -> None:
        for source in self._sources:
            if source.root is not None and source.root.is_dir():
                for path in sorted(source.root.glob(f"*/{STORE_FILE}")):
                    if str(path) not in source.stores:
                        source.stores[str(path)] = self._open(str(path))

    @property
    def stores(self) -> list[tuple[str, Store]]:
        """Every store found so far, with its location."""
        return [(loc, s) for src in self._sources for loc, s in src.stores.items()]

    async def runs(self) -> list[RunEntry]:
        """Every run in every store, newest first (stores that fail to answer are skipped,
        their error raised only when no store answers)."""
        self._scan()
        entries: list[RunEntry] = []
        errors: list[str] = []
        for location, store in self.stores:
            try:
                found = await store.list_runs()
            except StoreError as e:
                errors.append(str(e))
                continue
            for run in found:
                entries.append(RunEntry(run, store, location, _run_dir(location, run)))
        if errors and not entries:
            raise StoreError("; ".join(errors))
        self._runs = {e.run.run_id: e for e in entries}
        return sorted(entries, key=lambda e: e.run.created_at, reverse=True)

    async def run(self, run_id: str) -> RunEntry:
        """One run, read again (its status changes while it trains); raises
        :class:`NotFoundError`."""
        known = self._runs.get(run_id)
        if known is not None:
            for run in await known.store.list_runs():
                if run.run_id == run_id:
                    known.run = run
                    return known
        await self.runs()
        if run_id not in self._runs:
            raise NotFoundError(f"no run {run_id!r} in {self.describe()}")
        return self._runs[run_id]

    async def rollout(self, rollout_id: str) -> tuple[Store, Rollout, RunEntry | None]:
        """A rollout, its store and its run; raises :class:`NotFoundError`."""
        for _, store in self.stores:
            with contextlib.suppress(NotFoundError):
                rollout = await store.get_rollout(rollout_id)
                entry = None
                if rollout.run_id is not None:
                    with contextlib.suppress(NotFoundError):
                        entry = await self.run(rollout.run_id)
                return store, rollout, entry
        raise NotFoundError(f"no rollout {rollout_id!r} in {self.describe()}")

    def describe(self) -> str:
        """The sources, for messages and the page footer."""
        return ", ".join(s.spec for s in self._sources)

    async def close(self) -> None:
        """Close every store this catalog opened."""
        for source, owned in zip(self._sources, self._owned, strict=True):
            for store in source.stores.values() if owned else ():
                await store.close()


def _run_dir(location: str, run: Run) -> Path | None:
    """The run directory of ``run`` in a store at ``location``: the store file's own
    directory (``runs/NAME/store.sqlite``) or its sibling of the run's name."""
    if "://" in location:
        return None
    own = Path(location).parent
    for candidate in (own / run.name, own) if own.name != run.name else (own,):
        if (candidate / METRICS_FILE).exists() or (candidate / STORE_FILE).exists():
            return candidate
    return None


# ---- metrics ------------------------------------------------------------------------------------
_METRICS_CACHE: dict[Path, tuple[tuple[float, int], list[dict[str, Any]]]] = {}


def read_metrics(entry: RunEntry) -> list[dict[str, Any]]:
    """The run's lines of ``metrics.jsonl`` (read again only when the file changed)."""
    if entry.run_dir is None or not (entry.run_dir / METRICS_FILE).exists():
        return []
    path = entry.run_dir / METRICS_FILE
    stat = path.stat()
    key = (stat.st_mtime, stat.st_size)
    cached = _METRICS_CACHE.get(path)
    if cached is None or cached[0] != key:
        records = []
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):  # a line being written
                records.append(json.loads(line))
        _METRICS_CACHE[path] = cached = (key, records)
    return [r for r in cached[1] if r.get("run_id") in (None, entry.run.run_id)]


FIRST_METRICS = (
    "train/reward_mean",
    "val/reward_mean",
    "dev/reward_mean",
    "train/reward_std",
    "update/loss",
    "update/approx_kl",
    "update/kl",
    "update/entropy",
    "update/clip_frac",
    "update/grad_norm",
    "update/tokens_per_s",
    "rollout_s",
    "update_s",
    "sft/loss",
)
"""Metrics charted first, in this order; the others follow by name."""


Series = list[tuple[str, list[int], list[float]]]


def metric_series(records: Sequence[dict[str, Any]]) -> Series:
    """Every numeric metric as ``(name, steps, values)`` over the steps that logged it
    (several records of one step: the last wins), :data:`FIRST_METRICS` first."""
    by_name: dict[str, dict[int, float]] = {}
    for record in records:
        step = record.get("step")
        if not isinstance(step, int):
            continue
        for name, value in record.items():
            if name in ("step", "time", "run_id") or isinstance(value, bool):
                continue
            if isinstance(value, int | float) and math.isfinite(value):
                by_name.setdefault(name, {})[step] = float(value)
    first = {name: i for i, name in enumerate(FIRST_METRICS)}
    order = sorted(by_name, key=lambda n: (first.get(n, len(first)), n))
    return [(n, sorted(by_name[n]), [by_name[n][k] for k in sorted(by_name[n])]) for n in order]


# ---- tokens -------------------------------------------------------------------------------------
_TOKENIZERS: dict[Path, Any] = {}


def load_tokenizer(entry: RunEntry | None) -> tuple[Any | None, str]:
    """The run's tokenizer and where it came from, or None and why not."""
    if entry is None or entry.run_dir is None:
        return None, "the run directory is unknown (a store URL): token ids are shown as ids"
    for name in TOKENIZER_DIRS:
        path = entry.run_dir / name
        if (path / "tokenizer_config.json").exists():
            if path not in _TOKENIZERS:
                try:
                    from transformers import AutoTokenizer
                except ImportError:
                    return None, "decoding needs transformers (pip install 'voltrl[local]')"
                _TOKENIZERS[path] = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            return _TOKENIZERS[path], f"decoded with the tokenizer in {path}"
    return None, f"no tokenizer saved in {entry.run_dir} (LocalRL saves one): ids shown"


def tokens(ids: Sequence[int], tokenizer: Any | None) -> list[str]:
    """Each id as the text it stands for (``#id`` without a tokenizer)."""
    if tokenizer is None:
        return [f"#{i}" for i in ids]
    return [tokenizer.decode([i]) for i in ids]


@dataclass
class TrainingRow:
    """One training row of a rollout, as the trainer saw it."""

    prompt: list[str]
    response: list[str]
    mask: list[int]
    logprobs: list[float | None]
    reward: float | None
    advantage: float | None
    agent: str | None


async def training_rows(
    entry: RunEntry, rollout: Rollout, tokenizer: Any | None
) -> tuple[list[TrainingRow], str]:
    """The rows the trajectory builder makes of ``rollout`` with the run's trajectory settings,
    each with the advantage LocalRL's update gives it in its step's batch (every train
    rollout of the run at the rollout's resources version); and a note on what was shown."""
    from voltrl.trajectory import TrajectoryConfig, trajectories_from_store

    config = entry.run.config
    settings = config.get("trajectory") if isinstance(config.get("trajectory"), dict) else {}
    try:
        trajectory = TrajectoryConfig(**{**settings, "missing_token_ids": "drop"})
    except ValueError as e:
        return [], f"the run's trajectory settings do not load: {e}"
    mates = [rollout]
    if rollout.mode == "train" and rollout.resources_version is not None:
        query = RolloutQuery(
            run_id=rollout.run_id,
            mode="train",
            resources_version=rollout.resources_version,
            status=["succeeded"],
            limit=500,
        )
        mates = (await entry.store.browse_rollouts(query)).rollouts or [rollout]
        if all(m.rollout_id != rollout.rollout_id for m in mates):
            mates.append(rollout)
    built = await trajectories_from_store(entry.store, mates, trajectory)
    mine = next(t for t in built if t.rollout_id == rollout.rollout_id)
    if not mine.transitions:
        reasons = ", ".join(k for k in mine.stats if k.startswith("dropped/")) or "no rows"
        return [], f"the trajectory builder makes no training row of this rollout ({reasons})"
    if rollout.mode == "train":
        advantages, note = _advantages(config, built)
    else:
        advantages, note = {}, f"{rollout.mode} rollouts are not trained on: no advantage"
    rows = []
    for index, t in enumerate(mine.transitions):
        adv = advantages.get((mine.rollout_id, index))
        lps = list(t.response_logprobs or [])
        rows.append(
            TrainingRow(
                prompt=tokens(t.prompt_token_ids, tokenizer),
                response=tokens(t.response_token_ids, tokenizer),
                mask=list(t.response_mask or [1] * len(t.response_token_ids)),
                logprobs=[
                    lps[i] if i < len(lps) else None for i in range(len(t.response_token_ids))
                ],
                reward=t.reward,
                advantage=adv,
                agent=t.agent_name,
            )
        )
    return rows, note


def _advantages(
    config: dict[str, Any], trajectories: Sequence[Any]
) -> tuple[dict[tuple[str, int], float], str]:
    """Each row's advantage (keyed by rollout id and row index) as LocalRL's update computes
    it over this batch, and a note; none when the run is not LocalRL's or torch is missing."""
    from voltrl.trajectory import collate

    update = config.get("update")
    if not isinstance(update, dict):
        return {}, "advantages are shown for LocalRL runs"
    try:
        from voltrl.algorithms.local.update import PolicyUpdateConfig, batch_advantages
    except ImportError:
        return {}, "advantages need torch (pip install 'voltrl[local]')"
    batch = collate([t for t in trajectories if t.transitions])
    if not len(batch):
        return {}, ""
    advantages = batch_advantages(batch, PolicyUpdateConfig(**update)).tolist()
    keyed: dict[tuple[str, int], float] = {}
    seen: dict[str, int] = {}
    for rid, adv in zip(batch.rollout_ids, advantages, strict=True):
        index = seen.get(rid, 0)
        seen[rid] = index + 1
        keyed[rid, index] = adv
    groups = len(set(batch.group_ids))
    return keyed, (
        f"advantages as LocalRL's update computes them over the step's batch "
        f"({len(batch)} rows, {groups} groups)"
    )


# ---- spans, calls, workers ----------------------------------------------------------------------
@dataclass
class SpanNode:
    """A span at its depth in the tree, with its duration."""

    span: Span
    depth: int
    duration_s: float | None


def span_tree(spans: Sequence[Span]) -> list[SpanNode]:
    """Spans in tree order (each parent before its children, siblings by start time); spans
    whose parent is not recorded are roots."""
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[Span]] = {}
    for s in spans:
        parent = s.parent_id if s.parent_id in ids else None
        children.setdefault(parent, []).append(s)
    out: list[SpanNode] = []

    def walk(parent: str | None, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s.start_time):
            dur = None if s.end_time is None else s.end_time - s.start_time
            out.append(SpanNode(s, depth, dur))
            if depth < 50:
                walk(s.span_id, depth + 1)

    walk(None, 0)
    return out


def response_message(call: LLMCall) -> dict[str, Any]:
    """The assistant message the call answered with (of its choice)."""
    choices = call.response.get("choices") or []
    choice = next((c for c in choices if c.get("index") == call.choice_index), None)
    choice = choice or (choices[0] if choices else {})
    return choice.get("message") or {}


def pretty(value: Any) -> str:
    """Content as text: strings as they are, anything else as indented JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and "text" in p for p in value):
        return "\n".join(str(p["text"]) for p in value)
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


@dataclass
class WorkerRow:
    """A running attempt: who holds it, since when, its last heartbeat and lease."""

    worker_id: str
    rollout_id: str
    attempt_index: int
    started_s_ago: float
    heartbeat_s_ago: float
    lease_left_s: float
    where: str


async def workers(catalog: Catalog) -> list[WorkerRow]:
    """Every running attempt in every store (claims, heartbeats, leases)."""
    now = time.time()
    rows: list[WorkerRow] = []
    for location, store in catalog.stores:
        try:
            running = await store.browse_rollouts(RolloutQuery(status=["running"], limit=500))
        except StoreError:
            continue
        attempts = await asyncio.gather(
            *(store.get_attempts(r.rollout_id) for r in running.rollouts)
        )
        for r, tries in zip(running.rollouts, attempts, strict=True):
            for a in tries:
                if a.status == "running":
                    rows.append(
                        WorkerRow(
                            a.worker_id,
                            r.rollout_id,
                            a.index,
                            now - a.started_at,
                            now - a.heartbeat_at,
                            a.lease_expires_at - now,
                            location,
                        )
                    )
    return sorted(rows, key=lambda w: (w.worker_id, w.started_s_ago))
