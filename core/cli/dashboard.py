"""``voltrl dashboard [SOURCE ...]``: runs, rollouts, LLM calls and tokens in the browser."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from voltrl.cli.options import add_token_args, bearer_token
from voltrl.errors import VoltRLError

if TYPE_CHECKING:
    from voltrl.cli.options import Subparsers


def register(sub: Subparsers) -> None:
    """Add ``voltrl dashboard`` to the ``voltrl`` parser."""
    dashboard = sub.add_parser(
        "dashboard", help="runs, rollouts, LLM calls and tokens in the browser"
    )
    dashboard.add_argument(
        "sources",
        nargs="*",
        default=["runs"],
        help="run directories, a directory of them (default: runs), store files, or store "
        "URLs (http://, postgresql://)",
    )
    dashboard.add_argument("--host", default="127.0.0.1", help="interface to bind")
    dashboard.add_argument("--port", type=int, default=8500, help="port (default: 8500)")
    dashboard.add_argument(
        "--store-token-file",
        default=None,
        help="file holding the token of a store server among the sources",
    )
    add_token_args(dashboard)
    dashboard.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    from voltrl._http.serving import run
    from voltrl.observability.dashboard import run_dashboard

    store_token = None
    if args.store_token_file:
        try:
            store_token = Path(args.store_token_file).read_text().strip() or None
        except OSError as exc:
            raise VoltRLError(f"cannot read --store-token-file: {exc}") from None
    coro = run_dashboard(
        args.sources,
        host=args.host,
        port=args.port,
        token=bearer_token(args),
        store_token=store_token,
    )
    run(coro)
    return 0
