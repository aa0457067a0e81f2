"""The ``voltrl`` command line: the parser each command module adds its command to, and how an
error becomes an exit status.

    voltrl dev MODULE:AGENT --data FILE --llm-endpoint URL --model NAME
               [--max-tokens N] [--temperature T] [--top-p P] [--loggers NAMES]
    voltrl train CONFIG.yaml [--loggers NAMES]
    voltrl runs [--store PATH | --run-dir DIR]
    voltrl show RUN [ROLLOUT_ID] [--store SPEC | --run-dir DIR]
    voltrl audit RUN [--store SPEC | --run-dir DIR] [--tokenizer PATH] [--json] [--all]
    voltrl serve [--store SPEC] [--host H] [--port N] [--token-file F] [--backend URL ...]
    voltrl dashboard [SOURCE ...] [--host H] [--port N]
    voltrl gateway --store URL --backend URL [--token-file F] [--host H] [--port N]
    voltrl runner --store URL --agent MODULE:AGENT [--token-file F] [--workers N]
    voltrl model serve PATH|tiny [--host H] [--port N] [--served-name NAME] [--token-file F]
    voltrl teacher serve MODULE:FUNCTION [--host H] [--port N] [--seed N] [--token-file F]

Errors a user can fix (a bad module path, a missing data file, an unreachable endpoint) print
one line on stderr and exit with status 2; no traceback. A run stopped by its failures
(:class:`~voltrl.errors.TooManyFailuresError`, after each distinct error was printed) says so
in one line too and exits with status 1, as ``dev`` does when some rollouts failed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from voltrl._console import printable
from voltrl.cli import audit, dashboard, dev, model, runner, runs, serve, show, teacher, train
from voltrl.errors import TooManyFailuresError, VoltRLError

_COMMANDS = (dev, train, runs, show, audit, serve, dashboard, runner, model, teacher)
"""The command modules, in the order ``voltrl --help`` lists them (serve adds ``gateway`` too)."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``voltrl``: each command's ``func`` runs it."""
    parser = argparse.ArgumentParser(
        prog="voltrl", description="VoltRL: run, train and inspect agents trained with RL."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in _COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except VoltRLError as exc:
        message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"voltrl: error: {printable(message)}", file=sys.stderr)
        return 1 if isinstance(exc, TooManyFailuresError) else 2
    except KeyboardInterrupt:
        print("voltrl: interrupted", file=sys.stderr)
        return 130
