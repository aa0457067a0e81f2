"""``voltrl runs``: list the runs of a store or of a directory of run directories, with their
reward statistics."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl.errors import StoreError
from voltrl.store.spec import STORE_FILE, StoreSpec, parse_store

if TYPE_CHECKING:
    from voltrl.cli.options import Subparsers


def register(sub: Subparsers) -> None:
    """Add ``voltrl runs`` to the ``voltrl`` parser."""
    runs = sub.add_parser("runs", help="list runs and their reward statistics")
    runs.add_argument(
        "--store",
        default=None,
        help="a store: a store.sqlite file, a run directory, postgresql://... or http(s)://... "
        "(a store server's token from VOLTRL_TOKEN)",
    )
    runs.add_argument("--run-dir", default="runs", help="directory of run directories")
    runs.add_argument(
        "--status",
        action="append",
        choices=["running", "finished", "interrupted", "failed"],
        help="only runs with this status (repeatable)",
    )
    runs.add_argument("--kind", choices=["fit", "dev"], help="only fit or only dev runs")
    runs.add_argument("--name", default=None, help="only runs whose name contains this")
    runs.add_argument(
        "--wide", action="store_true", help="also the run id, store path and error; no wrapping"
    )
    runs.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    skipped: list[str] = []  # run directories' stores that cannot be read here

    async def collect() -> list[tuple[Any, ...]]:
        rows = []
        for spec in _store_specs(args):
            try:
                store = spec.open(read_only=True)
            except StoreError as e:
                if args.store:  # the one store asked for
                    raise
                skipped.append(str(e))
                continue
            try:
                for run in await store.list_runs():
                    if _run_shown(run, args):
                        counts = await store.rollout_counts(run.run_id)
                        rows.append((spec.describe(), run, counts))
            finally:
                await store.close()
        return rows

    _render(asyncio.run(collect()), args)
    for why in skipped:
        print(f"note: not listed: {why}", file=sys.stderr)
    return 0


def _render(rows: list[tuple[Any, ...]], args: argparse.Namespace) -> None:
    """Print the ``(store, run, rollout counts)`` rows as a table (or that there are none):
    the one place ``voltrl runs`` prints what it found. A run's reward is its
    :func:`~voltrl.observability.metrics.run_outcome`, as the dashboard and the end of a run
    give it."""
    import time

    from rich.console import Console
    from rich.table import Table

    from voltrl._console import printable
    from voltrl._console import text as console_text
    from voltrl.observability.metrics import outcome_of

    if not rows:
        print(printable(f"no runs found in {args.store or args.run_dir}"))
        return
    wide = args.wide
    table = Table(title="runs")
    # A long name folds onto more lines rather than being cut short; --wide never wraps.
    name_width = min(20, max(len(console_text(r[1].name)) for r in rows))
    table.add_column("name", overflow="fold", min_width=name_width)
    columns = ["status", "kind", "started", "rollouts", "reward"]
    for col in columns + (["algorithm", "run id", "store", "error"] if wide else []):
        table.add_column(col, overflow="fold")
    for path, run, counts in rows:
        outcome = outcome_of(run, counts)
        reward = "-"
        if outcome is not None and outcome.reward_mean is not None:
            reward = f"{outcome.reward_mean:.3f}"
            if outcome.rewarded < outcome.rollouts:
                reward += f" ({outcome.rewarded}/{outcome.rollouts})"
            if wide:
                reward += f" {outcome.of}"
        started = time.strftime("%m-%d %H:%M", time.localtime(run.created_at))
        by_status = {
            status: sum(c.count for c in counts if c.status == status)
            for status in ("failed", "cancelled")
        }
        ended = [f"{n} {status}" for status, n in by_status.items() if n]
        total = sum(c.count for c in counts)
        rollouts = f"{total}" + (f" ({', '.join(ended)})" if ended else "")
        cells = [run.name, run.status, run.kind, started, rollouts, reward]
        if wide:
            cells += [run.algorithm, run.run_id, str(path), run.error or ""]
        table.add_row(*(console_text(c) for c in cells))
    console = Console(width=100_000 if wide else None)
    console.print(table)
    console.print(
        "reward: the mean of the last validation (a prompt search's best), else of the dev "
        "rollouts, else of the last step; (6/8): 6 of the 8 rollouts there had a reward (the "
        "others failed, were cancelled, are running or returned none)",
        style="dim",
    )


def _store_specs(args: argparse.Namespace) -> list[StoreSpec]:
    """The store ``--store`` names, else the store of each run directory in ``--run-dir``."""
    if args.store:
        return [parse_store(args.store, existing=True)]
    root = Path(args.run_dir)
    paths = sorted(root.glob(f"*/{STORE_FILE}")) if root.exists() else []
    return [parse_store(path, existing=True) for path in paths]


def _run_shown(run: Any, args: argparse.Namespace) -> bool:
    """Whether ``voltrl runs``' filters keep ``run``."""
    return (
        (not args.status or run.status in args.status)
        and (not args.kind or run.kind == args.kind)
        and (not args.name or args.name in run.name)
    )
