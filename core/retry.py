"""Retries of HTTP requests, shared by the gateway (to its backends) and the store client (to a
store server): which answers are worth another try, exponential backoff with jitter, and the
server's ``Retry-After``.

:meth:`Backoff.run` makes one try after another: a try returns its result (done), raises (a
failure no retry can fix), or returns :class:`Retry`, which sleeps and tries again until the
tries run out, and then raises the last try's error.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from pydantic import Field

from voltrl.types import Model

T = TypeVar("T")

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
"""Answers worth another try: a timeout, rate limiting, a server or a proxy that failed."""


def retry_after_s(value: str | None) -> float | None:
    """Seconds asked for by a ``Retry-After`` header in seconds; None when absent or not a
    number of seconds (an HTTP date is not honoured)."""
    try:
        seconds = float(value or "")
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


@dataclass(frozen=True, slots=True)
class Retry:
    """What a try returns to ask for another: ``problem`` says what went wrong (logged),
    ``error`` is raised when no try is left, ``retry_after`` is the answer's ``Retry-After``."""

    problem: str
    error: Exception
    retry_after: str | None = None


@dataclass(frozen=True, slots=True)
class Backoff:
    """Up to ``retries`` tries after the first; before the k-th retry (k from 0) a pause drawn
    uniformly from ``[cap/2, cap]``, ``cap = min(max_s, base_s * 2**k)``, lengthened to the
    answer's ``Retry-After`` (itself capped at ``max_s``)."""

    retries: int
    base_s: float
    max_s: float

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        """Seconds to wait before retry ``attempt`` (0 for the first retry)."""
        cap = min(self.max_s, self.base_s * 2**attempt)
        pause = random.uniform(cap / 2, cap)
        asked = retry_after_s(retry_after)
        return pause if asked is None else max(pause, min(self.max_s, asked))

    async def run(
        self, attempt: Callable[[int], Awaitable[T | Retry]], what: str, log: logging.Logger
    ) -> T:
        """``attempt(0)``, then ``attempt(1)``, ... while they return :class:`Retry` and tries
        are left, each retry logged as a warning on ``log`` naming ``what``; the first other
        result is returned, and once tries run out the last :class:`Retry`'s error is raised."""
        tried = 0
        while True:
            outcome = await attempt(tried)
            if not isinstance(outcome, Retry):
                return outcome
            if tried >= self.retries:
                raise outcome.error
            pause = self.delay(tried, outcome.retry_after)
            tried += 1
            log.warning(
                "%s failed (%s); retry %d/%d in %.2fs",
                what, outcome.problem, tried, self.retries, pause,
            )  # fmt: skip
            await asyncio.sleep(pause)


class GatewayRetry(Model):
    """How a gateway retries a backend call: after a 408/429/5xx answer, a connection error or
    a timeout, up to ``retries`` more tries with exponential backoff and jitter from
    ``backoff_s`` to ``max_backoff_s`` (a backend's ``Retry-After`` is honoured up to that).

    Settable from ``Trainer(gateway_retry=...)``, ``LocalRL(gateway_retry=...)``, VERL's
    ``voltrl.gateway_retry``, YAML (``gateway_retry:``) and ``voltrl serve``/``gateway``.
    """

    retries: int = Field(3, ge=0)
    backoff_s: float = Field(0.25, ge=0)
    max_backoff_s: float = Field(8.0, ge=0)
    timeout_s: float = Field(600.0, gt=0)
    """Longest a backend may stay silent while answering one try."""
    connect_timeout_s: float = Field(10.0, gt=0)
