"""What the dashboard shows, read from the stores and run directories it was given.

Plain data for the templates: no HTML here. :class:`Catalog` finds runs in any number of stores
(run directories, store files, store servers, PostgreSQL); the other functions read one run's
metrics, decode token ids with the run's tokenizer, lay out spans as a tree and list the
running attempts. (A rollout's training rows: :mod:`.training_rows`; its outcome and
conversation: :mod:`.conversation`.)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from voltrl._redact import redact
from voltrl.errors import NotFoundError, StoreError, VoltRLError
from voltrl.observability import metrics
from voltrl.observability.dashboard.open_stores import IDLE_S, MAX_OPEN, OpenStores
from voltrl.observability.tokenizers import saved_tokenizer
from voltrl.store.base import Store
from voltrl.store.browse import RolloutQuery
from voltrl.store.spec import STORE_FILE, parse_store
from voltrl.types import Rollout, Run, Span

METRICS_FILE = "metrics.jsonl"


@dataclass
class RunEntry:
    """A run, where its store is, and its run directory when known (metrics, tokenizer)."""

    run: Run
    location: str
    """The store's location, as the catalog opens it (a path or URL)."""
    where: str
    """The location as pages show it (passwords hidden)."""
    run_dir: Path | None
    catalog: Catalog = field(repr=False, compare=False)

    @property
    def store(self) -> Store:
        """The run's store, opened again if it was closed (see :meth:`Catalog.store`)."""
        return self.catalog.store(self.location)


@dataclass
class _Source:
    spec: str
    root: Path | None = None  # a directory of run directories, scanned for new ones
    locations: list[str] = field(default_factory=list)  # of the stores found


class Catalog:
    """The stores the dashboard reads: each source is a directory of run directories
    (``runs/``, scanned again on every listing, so new runs appear), a run directory, a store
    file, or a store URL (``http://``, ``postgresql://``). A store server's token comes from
    ``token`` (else ``$VOLTRL_TOKEN``, as :func:`~voltrl.store.open_store` reads it).

    Store files are opened when a page needs them and closed again (at most ``max_open`` open,
    none unused for longer than ``idle_s``: :class:`~.open_stores.OpenStores`), so a directory
    of hundreds of runs costs no more threads and files than a few; a page holds what it uses
    through :meth:`hold`. Stores at URLs stay open (there are as many as sources); stores given
    as objects are used as they are and never closed here.
    """

    def __init__(
        self,
        sources: Sequence[str | Path | Store],
        *,
        token: str | None = None,
        max_open: int = MAX_OPEN,
        idle_s: float = IDLE_S,
    ) -> None:
        if not sources:
            raise VoltRLError("the dashboard needs a store: a run directory, a file or a URL")
        self._token = token
        self._kept: dict[str, Store] = {}  # location -> a store open all along
        self._owned: list[Store] = []  # those of them this catalog opened
        self._files = OpenStores(self._open, max_open=max_open, idle_s=idle_s)
        self._sources = [self._source(s) for s in sources]
        self._runs: dict[str, RunEntry] = {}
        self._listed: dict[str, tuple[tuple[int, ...], list[Run]]] = {}  # location -> runs

    def _source(self, source: str | Path | Store) -> _Source:
        if isinstance(source, Store):  # a store open elsewhere (voltrl serve's), not closed here
            location = str(getattr(source, "location", type(source).__name__))
            self._kept[location] = source
            return _Source(location, locations=[location])
        spec = str(source)
        path = Path(spec).expanduser()
        if "://" not in spec and path.is_dir() and not (path / STORE_FILE).exists():
            return _Source(spec, root=path)  # a directory of run directories
        try:
            where = parse_store(spec, token=self._token, existing=True)
        except StoreError as e:
            hint = " (no run was trained here yet: `make demo` makes one)" if spec == "runs" else ""
            raise VoltRLError(f"{e}{hint}; or a directory of run directories") from None
        if where.kind == "sqlite":
            return _Source(spec, locations=[str(where.sqlite_file)])
        self._kept[spec] = store = where.open(retries=2, read_only=True)
        self._owned.append(store)
        return _Source(spec, locations=[spec])

    @staticmethod
    def _open(location: str) -> Store:
        """A run's SQLite store with its own read-only connection, read on a thread: a
        page's queries never hold up the event loop, nor a trainer serving the same file, and
        never write to it (an older store is not upgraded by a look at it)."""
        return parse_store(location, existing=True).open(threaded=True, retries=2, read_only=True)

    def _scan(self) -> None:
        for source in self._sources:
            if source.root is not None and source.root.is_dir():
                known = set(source.locations)
                for path in sorted(source.root.glob(f"*/{STORE_FILE}")):
                    if str(path) not in known:
                        source.locations.append(str(path))

    @property
    def locations(self) -> list[str]:
        """Where every store found so far is."""
        return [loc for src in self._sources for loc in src.locations]

    def store(self, location: str) -> Store:
        """The store at ``location``, opened if it is a file not open now. Inside
        :meth:`hold` it stays open until the block ends; outside, until the next listing
        may close it."""
        kept = self._kept.get(location)
        return kept if kept is not None else self._files.get(location)

    def hold(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Keep the stores used inside the block open until it ends (a page's queries never
        meet a closed store); then close those over the bound or idle."""
        return self._files.hold()

    async def _list(self, location: str) -> list[Run]:
        """The runs of the store at ``location``; a store file that has not changed since
        the last listing is not opened again (idle run directories stay closed)."""
        stamp = _file_stamp(location) if location not in self._kept else None
        cached = self._listed.get(location)
        if stamp is not None and cached is not None and cached[0] == stamp:
            return cached[1]
        async with self.hold():  # one store at a time: a long listing never opens them all
            found = await self.store(location).list_runs()
        if stamp is not None:
            self._listed[location] = (stamp, found)
        return found

    async def runs(self) -> list[RunEntry]:
        """Every run in every store, newest first (stores that fail to answer are skipped,
        their error raised only when no store answers)."""
        self._scan()
        entries: list[RunEntry] = []
        errors: list[str] = []
        for location in self.locations:
            try:
                found = await self._list(location)
            except StoreError as e:
                errors.append(str(e))
                continue
            where = redact(location)
            for run in found:
                entries.append(RunEntry(run, location, where, _run_dir(location, run), self))
        if errors and not entries:
            raise StoreError("; ".join(errors))
        self._runs = {e.run.run_id: e for e in entries}
        return sorted(entries, key=lambda e: e.run.created_at, reverse=True)

    async def run(self, run_id: str) -> RunEntry:
        """One run, read again (its status changes while it trains); raises
        :class:`NotFoundError`."""
        known = self._runs.get(run_id)
        if known is not None:
            for run in await self._list(known.location):
                if run.run_id == run_id:
                    known.run = run
                    return known
        await self.runs()
        if run_id not in self._runs:
            raise NotFoundError(f"no run {run_id!r} in {self.describe()}")
        return self._runs[run_id]

    async def rollout(self, rollout_id: str) -> tuple[Store, Rollout, RunEntry | None]:
        """A rollout, its store and its run; raises :class:`NotFoundError`. The stores open
        now are asked first: a rollout is mostly opened from a page of its run."""
        self._scan()  # a run started since the last listing has a store of its own
        recent = [loc for loc in self._files.recent() if loc in self.locations]
        for location in dict.fromkeys([*recent, *self.locations]):
            async with self.hold():  # the others are closed again as the search goes on
                with contextlib.suppress(NotFoundError, StoreError):  # another may have it
                    rollout = await self.store(location).get_rollout(rollout_id)
                    break
        else:
            raise NotFoundError(f"no rollout {rollout_id!r} in {self.describe()}")
        store = self.store(location)  # the most recently used: still open, held from now on
        entry = None
        if rollout.run_id is not None:
            with contextlib.suppress(NotFoundError):
                entry = await self.run(rollout.run_id)
        return store, rollout, entry

    async def live_locations(self) -> list[str]:
        """The stores that may have running attempts: all but those whose every run has
        ended (known from the listing, so idle run directories are not opened)."""
        self._scan()
        live = []
        for location in self.locations:
            with contextlib.suppress(StoreError):  # one that fails to answer is asked anyway
                runs = await self._list(location)
                if runs and all(r.status != "running" for r in runs):
                    continue
            live.append(location)
        return live

    def describe(self) -> str:
        """The sources, for messages and the page footer (passwords in URLs hidden, paths
        absolute)."""
        return ", ".join(
            str(Path(s.spec).expanduser().resolve()) if Path(s.spec).exists() else redact(s.spec)
            for s in self._sources
        )

    async def close(self) -> None:
        """Close every store this catalog opened."""
        await self._files.close()
        for store in self._owned:
            await store.close()


def _file_stamp(location: str) -> tuple[int, ...] | None:
    """What changes when a SQLite store file is written: its size and time, and those of its
    write-ahead log while it holds pages. Opening and closing the store change none of them
    (a reader leaves the log empty); None where the location is not a file."""
    path = Path(location)
    try:
        main = path.stat()
    except OSError:
        return None
    try:
        wal = Path(f"{location}-wal").stat()
        log = (wal.st_size, wal.st_mtime_ns) if wal.st_size else (0, 0)
    except OSError:
        log = (0, 0)
    return (main.st_size, main.st_mtime_ns, *log)


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


def keep_newest(cache: OrderedDict[Any, Any], key: Any, value: Any, limit: int) -> None:
    """Put ``value`` in ``cache`` as its newest entry, dropping the oldest past ``limit``."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > limit:
        cache.popitem(last=False)


# ---- metrics ------------------------------------------------------------------------------------
METRICS_KEPT = 32
"""Runs whose parsed ``metrics.jsonl`` is kept (the most recently read)."""
_METRICS_CACHE: OrderedDict[Path, tuple[tuple[float, int], list[dict[str, Any]]]] = OrderedDict()


def read_metrics(entry: RunEntry) -> list[dict[str, Any]]:
    """The run's lines of ``metrics.jsonl`` (read again only when the file changed)."""
    if entry.run_dir is None or not (entry.run_dir / METRICS_FILE).exists():
        return []
    path = entry.run_dir / METRICS_FILE
    stat = path.stat()
    key = (stat.st_mtime, stat.st_size)
    cached = _METRICS_CACHE.get(path)
    if cached is None or cached[0] != key:
        cached = (key, metrics.read_metrics(path))
    keep_newest(_METRICS_CACHE, path, cached, METRICS_KEPT)
    return [r for r in cached[1] if r.get("run_id") in (None, entry.run.run_id)]


# ---- tokens -------------------------------------------------------------------------------------
TOKENIZERS_KEPT = 4
"""Tokenizers kept loaded (the most recently used): each may hold tens of megabytes."""
_TOKENIZERS: OrderedDict[Path, Any] = OrderedDict()
_TOKENIZERS_LOCK = threading.Lock()  # pages decode on threads


def tokenizer_dir(entry: RunEntry | None) -> tuple[Path | None, str]:
    """Where the run's tokenizer is saved and what the pages say of it, or None and why
    token ids are shown as ids (nothing is loaded)."""
    if entry is None or entry.run_dir is None:
        return None, "the run directory is unknown (a store URL): token ids are shown as ids"
    path = saved_tokenizer(entry.run_dir)
    if path is not None:
        return path, f"decoded with the tokenizer in {path}"
    return None, f"no tokenizer saved in {entry.run_dir} (LocalRL saves one): ids shown"


def load_tokenizer(entry: RunEntry | None) -> tuple[Any | None, str]:
    """The run's tokenizer and where it came from, or None and why not."""
    path, note = tokenizer_dir(entry)
    if path is None:
        return None, note
    with _TOKENIZERS_LOCK:
        tokenizer = _TOKENIZERS.get(path)
    if tokenizer is None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            return None, "decoding needs transformers (pip install 'voltrl[local]')"
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    with _TOKENIZERS_LOCK:
        keep_newest(_TOKENIZERS, path, tokenizer, TOKENIZERS_KEPT)
    return tokenizer, note


def tokens(ids: Sequence[int], tokenizer: Any | None) -> list[str]:
    """Each id as the text it stands for (``#id`` without a tokenizer), made visible: a line
    break shows as ``↵`` before it, a tab as ``→``, a carriage return as ``␍``, a token with
    no text as ``∅``."""
    if tokenizer is None:
        return [f"#{i} " for i in ids]
    return [_visible(text) for text in tokenizer.batch_decode([[i] for i in ids])]


def _visible(text: str) -> str:
    """A token's text with the characters that would take no room on the page marked (a
    carriage return, which HTML would read as a line break, as ``␍`` alone)."""
    return text.replace("\r", "␍").replace("\t", "→\t").replace("\n", "↵\n") or "∅"


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
    for location in await catalog.live_locations():
        async with catalog.hold():  # one store at a time
            store = catalog.store(location)
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
                            redact(location),
                        )
                    )
    return sorted(rows, key=lambda w: (w.worker_id, w.started_s_ago))
