"""``voltrl dashboard``: runs, rollouts, calls and tokens in the browser, from any store.

:func:`dashboard_app` is the web app (also mounted by ``voltrl serve`` under ``/ui``),
:class:`Catalog` the stores it reads, :func:`run_dashboard` the command. Pages are rendered on
the server (Jinja2); charts (uPlot) and live updates (htmx) come from vendored files, so the
dashboard works offline and installs with the core package.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from voltrl.observability.dashboard.app import dashboard_app
from voltrl.observability.dashboard.data import Catalog

DEFAULT_PORT = 8500
"""Port of ``voltrl dashboard`` unless ``--port`` says otherwise."""

__all__ = ["DEFAULT_PORT", "Catalog", "dashboard_app", "run_dashboard"]


async def run_dashboard(
    sources: Sequence[str | Path],
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str | None = None,
    store_token: str | None = None,
) -> None:
    """Serve the dashboard over ``sources`` until SIGINT or SIGTERM. Off loopback it needs a
    ``token``; ``store_token`` is the token of a store server among the sources."""
    from voltrl._http.serving import require_token_off_loopback, served, wait_for_signal

    require_token_off_loopback(host, token)
    catalog = Catalog(sources, token=store_token)
    try:
        async with served(dashboard_app(catalog, token=token), host, port, 2.0) as url:
            auth = " (sign in with the token)" if token else ""
            print(f"voltrl dashboard: {url}/{auth} reading {catalog.describe()}", flush=True)
            await wait_for_signal()
    finally:
        await catalog.close()
