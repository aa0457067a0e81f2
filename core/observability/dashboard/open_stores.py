"""The stores the dashboard has open: opened when a page needs one, closed when idle or when too
many are open.

An open SQLite store costs a thread (its reader: the dashboard opens stores read-only, so
without a WAL checkpointer) and three file descriptors (the file, its WAL and its index); a
directory of 400 run directories, each kept open, would pass the usual limit of 1,024
descriptors. :class:`OpenStores` keeps at most ``max_open`` of them (the least
recently used is closed first) and closes any unused for ``idle_s`` seconds.

A store is never closed under a page that is using it: whatever :meth:`OpenStores.get` returns
inside :meth:`OpenStores.hold` (the dashboard holds each request) stays open until the block
ends, even past ``max_open``; the bound applies again then.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar

from voltrl.errors import StoreError
from voltrl.store.base import Store

MAX_OPEN = 16
"""Stores kept open at most (beyond those pages are using)."""
IDLE_S = 60.0
"""Seconds after which an unused store is closed."""

# What the current block (a request, with the tasks it starts) got: released when it ends.
_HELD: ContextVar[list[tuple[OpenStores, str]] | None] = ContextVar("_HELD", default=None)


class OpenStores:
    """Stores by location, each opened by ``open(location)`` when first asked for; at most
    ``max_open`` kept open, none longer than ``idle_s`` unused. Used from one event loop."""

    def __init__(
        self, open: Callable[[str], Store], *, max_open: int = MAX_OPEN, idle_s: float = IDLE_S
    ) -> None:
        if max_open < 1 or idle_s <= 0:
            raise ValueError("max_open must be at least 1 and idle_s positive")
        self._open = open
        self._max_open = max_open
        self._idle_s = idle_s
        self._stores: OrderedDict[str, Store] = OrderedDict()  # least recently used first
        self._used: dict[str, float] = {}  # location -> when last asked for (monotonic)
        self._holds: Counter[str] = Counter()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._trimming: asyncio.Task[None] | None = None

    def recent(self) -> list[str]:
        """The locations of the open stores, most recently used first."""
        return list(reversed(self._stores))

    def get(self, location: str) -> Store:
        """The store at ``location``, opened now if it is not open; inside :meth:`hold` it
        stays open until the block ends."""
        store = self._stores.get(location)
        if store is None:
            store = self._stores[location] = self._open(location)
        else:
            self._stores.move_to_end(location)
        self._used[location] = time.monotonic()
        held = _HELD.get()
        if held is not None:
            held.append((self, location))
            self._holds[location] += 1
        return store

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Keep the stores got inside the block open until it ends; then close what is over
        the bound or idle. Blocks nest: an inner one releases only what it got."""
        held: list[tuple[OpenStores, str]] = []
        reset = _HELD.set(held)
        try:
            yield
        finally:
            _HELD.reset(reset)
            for pool, location in held:
                pool._release(location)
            for pool in {pool for pool, _ in held}:
                await pool.trim()

    def _release(self, location: str) -> None:
        left = self._holds[location] - 1
        if left > 0:
            self._holds[location] = left
        else:  # its last holder (or the pool was closed under it)
            self._holds.pop(location, None)

    async def trim(self) -> None:
        """Close the stores nobody holds that are over the bound (least recently used first)
        or unused for ``idle_s``; come back later for those that will be idle by then."""
        now = time.monotonic()
        free = [loc for loc in self._stores if not self._holds[loc]]
        over = len(self._stores) - self._max_open
        doomed = [
            loc for i, loc in enumerate(free) if i < over or now - self._used[loc] >= self._idle_s
        ]
        closing = []
        for location in doomed:  # all taken out first: a page may open the location again
            closing.append(self._stores.pop(location))
            del self._used[location]
            self._holds.pop(location, None)
        for store in closing:
            with contextlib.suppress(StoreError, OSError):  # it is let go all the same
                await store.close()
        loop = asyncio.get_running_loop()
        if self._stores and (self._timer is None or self._timer_loop is not loop):
            self._timer, self._timer_loop = loop.call_later(self._idle_s, self._trim_later), loop

    def _trim_later(self) -> None:
        self._timer = None
        self._trimming = asyncio.ensure_future(self.trim())  # kept: a task nobody holds may vanish

    async def close(self) -> None:
        """Close every open store, held or not."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._stores:
            _, store = self._stores.popitem()
            await store.close()
        self._used.clear()
        self._holds.clear()
