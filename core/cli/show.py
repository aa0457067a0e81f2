"""``voltrl show RUN [ROLLOUT_ID]``: one run (rollouts, metric curves) or one of its rollouts."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from voltrl.cli.options import add_token_args, bearer_token

if TYPE_CHECKING:
    from voltrl.cli.options import Subparsers


def register(sub: Subparsers) -> None:
    """Add ``voltrl show`` to the ``voltrl`` parser."""
    show = sub.add_parser("show", help="one run (rollouts, metric curves) or one of its rollouts")
    show.add_argument(
        "run",
        metavar="RUN",
        help="a run name or run id (of several runs named so: the latest), or a run directory",
    )
    show.add_argument(
        "rollout",
        nargs="?",
        default=None,
        metavar="ROLLOUT_ID",
        help="show this rollout of the run (its id or a unique prefix): calls, rewards, spans",
    )
    show.add_argument(
        "--store", default=None, help="a store.sqlite file, sqlite:///, postgresql://, http(s)://"
    )
    show.add_argument("--run-dir", default="runs", help="directory of run directories")
    add_token_args(show)
    show.add_argument(
        "--full", action="store_true", help="fold nothing: whole messages, tracebacks, spans"
    )
    show.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    from voltrl.observability.show import show

    return show(
        args.run,
        args.rollout,
        store=args.store,
        run_dir=args.run_dir,
        token=bearer_token(args),
        full=args.full,
    )
