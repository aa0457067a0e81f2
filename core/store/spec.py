"""Store specs: the one place where what a user names (a path, a run directory, a URL, with a
token) becomes a store.

Every reader and writer of stores resolves specs here: the trainer (``store=``), ``voltrl
serve``, ``voltrl show``, ``voltrl runs``, the dashboard and ``vl.SFT(source=)``. So a spec means
the same everywhere, a store server's token comes from one rule (the one passed, else
``$VOLTRL_TOKEN``), and a spec is printed the same way everywhere (passwords hidden).

Specs: ``memory`` (or None); a file path or ``sqlite:///PATH`` (SQLite); a run directory (its
``store.sqlite``); ``postgresql://USER:PASSWORD@HOST:PORT/DATABASE`` (or ``postgres://``; the
``postgres`` extra); ``http://`` or ``https://`` (a store server).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from voltrl._redact import redact
from voltrl.errors import StoreError

if TYPE_CHECKING:
    from voltrl.store.base import Store

STORE_FILE = "store.sqlite"
"""A run directory's SQLite store."""

TOKEN_ENV = "VOLTRL_TOKEN"
"""Where a store server's token comes from when none is passed."""

StoreKind = Literal["memory", "sqlite", "postgresql", "http"]


@dataclass(frozen=True)
class StoreSpec:
    """A resolved store spec: its kind, its target (a SQLite file or a URL) and, for a store
    server, its token (never shown)."""

    kind: StoreKind
    target: str
    token: str | None = field(default=None, repr=False)

    @property
    def sqlite_file(self) -> Path | None:
        """The SQLite file, for a SQLite store (None otherwise)."""
        return Path(self.target) if self.kind == "sqlite" else None

    def describe(self) -> str:
        """The spec fit to print: an absolute path, or the URL with its password hidden."""
        if self.kind == "sqlite":
            return str(Path(self.target).resolve())
        return redact(self.target)

    def open(
        self, *, threaded: bool = False, retries: int | None = None, read_only: bool = False
    ) -> Store:
        """Open the store. ``threaded``: a SQLite store with its own connection, used on a
        thread, so a reader's queries never hold up the event loop, nor a trainer writing the
        same file from another store object. ``retries``: a store server's, when not the
        default that rides out a restart (a page a person waits on fails sooner).
        ``read_only``: a SQL store that writes nothing and refuses writes (a reader's: a
        store server decides for itself)."""
        if self.kind == "memory":
            from voltrl.store.memory import InMemoryStore

            return InMemoryStore()
        if self.kind == "http":
            from voltrl.store.http import HTTPStore

            if retries is None:
                return HTTPStore(self.target, token=self.token)
            return HTTPStore(self.target, token=self.token, retries=retries)
        from voltrl.store.sql import SQLStore

        return SQLStore(self.target, threaded=threaded, read_only=read_only)


def parse_store(
    spec: str | Path | None, *, token: str | None = None, existing: bool = False
) -> StoreSpec:
    """Resolve ``spec`` (see the module docstring). ``token``: a store server's bearer token
    (else ``$VOLTRL_TOKEN``). ``existing``: the store must exist already (readers: ``voltrl
    show``, the dashboard, SFT's sources), so a mistyped path is an error, not a new empty
    store. Raises :class:`~voltrl.errors.StoreError` naming what was expected."""
    text = "memory" if spec is None else str(spec)
    if text == "memory":
        return StoreSpec("memory", "memory")
    if text.startswith(("http://", "https://")):
        return StoreSpec("http", text, token or os.environ.get(TOKEN_ENV) or None)
    if text.startswith(("postgresql://", "postgres://")):
        return StoreSpec("postgresql", text)
    if "://" in text and not text.startswith("sqlite:"):
        raise StoreError(
            f"unknown store {redact(text)!r}: expected 'memory', a file path, a run directory, "
            "sqlite:///PATH, postgresql://HOST:PORT/DATABASE or http(s)://HOST:PORT"
        )
    from voltrl.store.sql import sqlite_path

    path = sqlite_path(text)
    if path.is_dir():
        if not (path / STORE_FILE).is_file():
            raise StoreError(f"{text} is a directory without a {STORE_FILE}: not a run directory")
        path = path / STORE_FILE
    elif existing and not path.is_file():
        raise StoreError(f"store {text} does not exist: expected a run directory or a store file")
    return StoreSpec("sqlite", str(path))


def absolute_spec(spec: str | Path) -> str:
    """``spec`` as it names the same store from any directory: a file path, a run directory or
    a ``sqlite:///`` URL made absolute (``runs/teacher`` -> ``/home/me/project/runs/teacher``);
    ``memory`` and server URLs unchanged. What a run's ``train.yaml`` records, so that it runs
    again from elsewhere."""
    text = str(spec)
    if text == "memory" or ("://" in text and not text.startswith("sqlite:")):
        return text
    from voltrl.store.sql import sqlite_path

    return str(sqlite_path(text).resolve())


def open_store(
    spec: str | Path | None,
    *,
    token: str | None = None,
    existing: bool = False,
    threaded: bool = False,
    read_only: bool = False,
) -> Store:
    """The store ``spec`` names, opened (:func:`parse_store`, then :meth:`StoreSpec.open`).
    Raises :class:`~voltrl.errors.StoreError` when it cannot be opened."""
    where = parse_store(spec, token=token, existing=existing)
    return where.open(threaded=threaded, read_only=read_only)
