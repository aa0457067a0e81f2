"""Options several ``voltrl`` commands (and the samples' ``run.py`` scripts) share: the bearer
token, given on the command line, in a file or in the environment; the experiment trackers a run
logs to (``--loggers tensorboard,wandb``)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from voltrl.errors import VoltRLError

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]
    """What each command module's ``register`` adds its parser to."""


def add_token_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--token-file`` and ``--token`` (read by :func:`bearer_token`)."""
    parser.add_argument(
        "--token-file", default=None, help="file holding the bearer token (or set $VOLTRL_TOKEN)"
    )
    parser.add_argument(
        "--token",
        default=None,
        help="bearer token (visible to other users in ps: prefer the above)",
    )


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """Add what finds one recorded run (``voltrl show``, ``voltrl audit``): ``RUN``,
    ``--store``, ``--run-dir`` and the token's arguments."""
    parser.add_argument(
        "run",
        metavar="RUN",
        help="a run name or run id (of several runs named so: the latest), or a run directory",
    )
    parser.add_argument(
        "--store", default=None, help="a store.sqlite file, sqlite:///, postgresql://, http(s)://"
    )
    parser.add_argument("--run-dir", default="runs", help="directory of run directories")
    add_token_args(parser)


def bearer_token(args: argparse.Namespace) -> str | None:
    """The bearer token: ``--token``, else the first line of ``--token-file``, else
    ``$VOLTRL_TOKEN``."""
    if args.token:
        return args.token
    if args.token_file:
        try:
            value = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise VoltRLError(f"cannot read --token-file: {exc}") from None
        if not value:
            raise VoltRLError(f"--token-file {args.token_file} is empty")
        return value
    return os.environ.get("VOLTRL_TOKEN") or None


def add_loggers_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--loggers NAME[,NAME...]``: the run's trackers besides ``metrics.jsonl``, as
    ``Trainer(loggers=...)`` takes them (a list of names; ``[]`` when not given)."""
    from voltrl.observability.trackers import LOGGER_NAMES

    parser.add_argument(
        "--loggers",
        type=logger_names,
        default=[],
        metavar="NAMES",
        help="experiment trackers besides metrics.jsonl, comma-separated: "
        + ", ".join(n for n in LOGGER_NAMES if n != "jsonl")
        + " (options such as a W&B project: the trainer's loggers= or train.yaml)",
    )


def logger_names(value: str) -> list[str]:
    """``--loggers``' value as a list of tracker names; an unknown name is a usage error."""
    from voltrl.observability.trackers import LOGGER_NAMES

    names = [n.strip() for n in value.split(",") if n.strip()]
    if unknown := [n for n in names if n not in LOGGER_NAMES]:
        raise argparse.ArgumentTypeError(
            f"unknown logger {unknown[0]!r}: choose from {', '.join(LOGGER_NAMES)}"
        )
    return names
