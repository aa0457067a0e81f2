"""The retry helper shared by the gateway and the store client (``voltrl.retry``)."""

from __future__ import annotations

import logging

import pytest

from voltrl.retry import Backoff, Retry, retry_after_s

LOG = logging.getLogger("test_retry")


def test_retry_after_is_read_in_seconds_only() -> None:
    assert retry_after_s("3") == 3.0 and retry_after_s("0.5") == 0.5
    for value in (None, "", "soon", "-1", "nan", "inf", "Wed, 21 Oct 2026 07:28:00 GMT"):
        assert retry_after_s(value) is None, value


def test_delay_doubles_with_jitter_up_to_the_cap_and_honours_retry_after() -> None:
    backoff = Backoff(retries=5, base_s=0.1, max_s=1.0)
    for attempt, cap in [(0, 0.1), (1, 0.2), (3, 0.8), (4, 1.0), (9, 1.0)]:
        for _ in range(50):
            assert cap / 2 <= backoff.delay(attempt) <= cap
    assert backoff.delay(0, "0.5") == 0.5
    assert backoff.delay(0, "30") == 1.0  # capped at max_s
    assert 0.05 <= backoff.delay(0, "bad") <= 0.1


async def test_run_retries_until_a_result_then_returns_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tries: list[int] = []

    async def attempt(tried: int) -> str | Retry:
        tries.append(tried)
        return "done" if tried == 2 else Retry(f"flaky {tried}", RuntimeError("never raised"))

    with caplog.at_level(logging.WARNING, LOG.name):
        assert await Backoff(3, 0.001, 0.001).run(attempt, "GET /thing", LOG) == "done"
    assert tries == [0, 1, 2]
    assert [r.getMessage() for r in caplog.records] == [
        "GET /thing failed (flaky 0); retry 1/3 in 0.00s",
        "GET /thing failed (flaky 1); retry 2/3 in 0.00s",
    ]


async def test_run_raises_the_last_error_once_tries_run_out_and_never_retries_a_raise() -> None:
    tries: list[int] = []

    async def flaky(tried: int) -> str | Retry:
        tries.append(tried)
        return Retry("down", ValueError(f"down after try {tried}"))

    with pytest.raises(ValueError, match="down after try 2"):
        await Backoff(2, 0.001, 0.001).run(flaky, "POST /x", LOG)
    assert tries == [0, 1, 2]

    async def broken(tried: int) -> str | Retry:
        tries.append(tried)
        raise KeyError("for good")

    tries.clear()
    with pytest.raises(KeyError):
        await Backoff(2, 0.001, 0.001).run(broken, "POST /x", LOG)
    assert tries == [0]
