"""``voltrl show RUN [ROLLOUT_ID]``: one run (rollouts, metric curves) or one of its rollouts."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from voltrl.cli.options import add_run_args, bearer_token

if TYPE_CHECKING:
    from voltrl.cli.options import Subparsers


def register(sub: Subparsers) -> None:
    """Add ``voltrl show`` to the ``voltrl`` parser."""
    show = sub.add_parser("show", help="one run (rollouts, metric curves) or one of its rollouts")
    add_run_args(show)
    show.add_argument(
        "rollout",
        nargs="?",
        default=None,
        metavar="ROLLOUT_ID",
        help="show this rollout of the run (its id or a unique prefix): calls, rewards, spans",
    )
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
