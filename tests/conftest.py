"""Fixtures every folder of tests shares: the gateway ``env``, and clean-up after each test and
the session (the store fixtures are ``store/conftest.py``'s)."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator

import pytest
from gateway_env import SERVED, Env, gateway_env

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session", autouse=True)
def _stop_postgres() -> Iterator[None]:
    """Stop the PostgreSQL server of tests/pg.py, if a test started one, when the session ends."""
    yield
    from pg import stop_cluster

    stop_cluster()


@pytest.fixture(autouse=True)
def _forget_modules_of_temporary_directories(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """A test that runs ``voltrl train DIR/agents.py:...`` in this process leaves the file in
    ``sys.modules`` (as ``agents``) and DIR on ``sys.path``; a later test here that imports a
    package of that name (the OpenAI Agents SDK is ``agents``) got the file. After each test,
    modules loaded from the temporary directories and those directories on the path go."""
    modules = sys.modules.copy()
    yield
    base = str(tmp_path_factory.getbasetemp())
    sys.path[:] = [p for p in sys.path if not p.startswith(base)]
    # names only: a list of (name, module) pairs made GC sweep the whole heap, 15 ms a test
    loaded = [name for name, module in sys.modules.items() if modules.get(name) is not module]
    for name in loaded:
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(base):
            if name in modules:
                sys.modules[name] = modules[name]
            else:
                del sys.modules[name]


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    options = dict(model=SERVED, resources_version=lambda: 7, retries=2, backoff_s=0.001)
    async with gateway_env(**options, max_backoff_s=0.01) as e:
        yield e
