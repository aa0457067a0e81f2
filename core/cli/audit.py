"""``voltrl audit RUN``: the token-drift audit of a run's recorded calls, in the terminal or as
JSON; exit status 1 when a row it trains is not the tokens the model sampled.

The audit is :mod:`voltrl.trajectory.audit`'s, loaded by :mod:`voltrl.observability.audit_views`
(``docs/fidelity.md``); this module renders it: the summary, a table per agent, then each
diverging call with its context, the divergence marked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from voltrl.cli.options import add_run_args, bearer_token

if TYPE_CHECKING:
    from rich.console import Console

    from voltrl.cli.options import Subparsers
    from voltrl.observability.audit_views import RunAudit
    from voltrl.trajectory.audit import AuditCounts, CallAudit, Check

SHOWN = 10
"""Diverging calls printed unless ``--limit`` or ``--all`` says otherwise."""
PROGRESS_FROM = 50
"""Rollouts from which the audit shows its progress on stderr."""


def register(sub: Subparsers) -> None:
    """Add ``voltrl audit`` to the ``voltrl`` parser."""
    audit = sub.add_parser(
        "audit",
        help="check a run's token ids: re-rendered prompts, continuations, trained tokens",
        description=(
            "The token-drift audit of a run: is each recorded call's prompt what the chat "
            "template makes of its messages, does it start with its agent's previous call's "
            "prompt + response (else trajectory mode splits the row), and is every token a "
            "row trains a sampled one. Exit status: 0 when no trained token drifted, 1 when "
            "some did (trained-token drift), 2 on a usage error."
        ),
    )
    add_run_args(audit)
    audit.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH_OR_NAME",
        help="re-render with this tokenizer (a directory, a hub or packaged model name, tiny) "
        "instead of the one the run saved in its directory",
    )
    audit.add_argument(
        "--limit",
        type=_count,
        default=SHOWN,
        metavar="N",
        help=f"diverging calls shown in full (default {SHOWN})",
    )
    audit.add_argument("--all", action="store_true", help="show every diverging call")
    audit.add_argument("--json", action="store_true", help="print the whole audit as JSON")
    audit.set_defaults(func=_command)


def _count(value: str) -> int:
    """``--limit``'s value: a whole number, 0 or more (else a usage error)."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"not a count: {value!r} (0 or more)")
    return n


def _command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from voltrl._console import printable
    from voltrl.observability.audit_views import as_json, audit_run
    from voltrl.observability.run_views import find_run

    async def load() -> RunAudit:
        found = await find_run(
            args.run, store=args.store, run_dir=args.run_dir, token=bearer_token(args)
        )
        try:
            with _progress() as (start, advance):
                return await audit_run(
                    found,
                    run_dir=args.run_dir,
                    tokenizer=args.tokenizer,
                    on_start=start,
                    on_done=advance,
                )
        finally:
            await found.store.close()

    audit = asyncio.run(load())
    if args.json:
        print(json.dumps(as_json(audit), indent=2, ensure_ascii=False))
    else:
        console = Console(highlight=False, markup=False, soft_wrap=True)
        render(printable(audit), console, limit=None if args.all else args.limit)
    return 1 if audit.summary.counts.trained_drift else 0


@contextmanager
def _progress() -> Iterator[tuple[Any, Any]]:
    """``(start(total), advance(done))`` for :func:`audit_run`: a progress bar on stderr for a
    run of :data:`PROGRESS_FROM` rollouts or more."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    bar = Progress(
        "auditing rollouts",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    task: list[Any] = []

    def start(total: int) -> None:
        if total >= PROGRESS_FROM:
            bar.start()
            task.append(bar.add_task("audit", total=total))

    def advance(done: int) -> None:
        if task:
            bar.update(task[0], completed=done)

    try:
        yield start, advance
    finally:
        bar.stop()


# ---- rendering ----------------------------------------------------------------------------------
def render(audit: RunAudit, console: Console, *, limit: int | None = SHOWN) -> None:
    """The audit on ``console``: summary, agents, diverging calls (``limit`` of them, None:
    all) and every trained-token drift."""
    from rich.text import Text

    counts = audit.summary.counts
    console.print(
        Text(f"token-drift audit of run {audit.run.name} ({audit.run.run_id})", style="bold")
    )
    console.print(f"store {audit.where}; {audit.tokenizer_note}")
    console.print(f"{audit.summary.rollouts} rollouts, {counts.calls} calls")
    for line in summary_lines(counts):
        console.print(line)
    if audit.summary.agents:
        console.print(Text("per agent", style="bold"))
        for line in agent_lines(audit.summary.agents):
            console.print(f"  {line}")
    diverging = audit.summary.diverging
    if diverging:
        shown = diverging if limit is None else diverging[:limit]
        console.print(
            Text(f"diverging calls ({len(shown)} of {len(diverging)} shown)", style="bold")
        )
        for call in shown:
            for line in call_lines(call):
                console.print(line)
        if len(shown) < len(diverging):
            console.print(f"… {len(diverging) - len(shown)} more: --all shows every one")
    drift = audit.summary.trained_drift
    if drift:
        console.print(Text(f"trained-token drift ({len(drift)})", style="bold red"))
        for d in drift:
            console.print(f"  rollout {d.rollout_id} · agent {d.agent_name or '-'}: {d.describe()}")


def summary_lines(counts: AuditCounts) -> list[str]:
    """The summary: calls audited, identical, diverging, not checkable by reason; merged and
    split continuations; the trained-token drift."""
    from voltrl.trajectory.audit import percent

    rate = percent(counts.merge_rate)
    lines = [
        f"calls audited: {counts.audited} of {counts.calls}: {counts.identical} identical, "
        f"{counts.diverging} diverging, {counts.not_checkable} not checkable",
        f"  template (prompt ids = the messages rendered): {counts.template_identical} "
        f"identical, {counts.template_diverging} diverging",
        f"  continuations (prompt starts with the agent's previous prompt + response): "
        f"{counts.merged} merged, {counts.split} split (merge rate {rate})",
    ]
    if counts.split:
        lines.append(
            f"    split: {counts.split - counts.split_rebuilt} in the previous answer (it came "
            f"back changed, or not at all: drift), {counts.split_rebuilt} before it (the "
            "conversation was rebuilt: a new one, a history rendered anew)"
        )
    if counts.reasons:
        lines.append("  not checked: " + ", ".join(f"{k} {v}" for k, v in counts.reasons.items()))
    drift = counts.trained_drift
    lines.append(
        f"trained-token drift: {drift} row(s) train tokens that were not sampled (exit 1)"
        if drift
        else "trained-token drift: none (every trained token was sampled)"
    )
    return lines


def agent_lines(agents: dict[str, AuditCounts]) -> list[str]:
    """The counts per agent, one aligned line each under a header."""
    from voltrl.trajectory.audit import percent

    columns = ("calls", "audited", "identical", "diverging", "merged", "split", "merge rate")
    rows = [("agent", *columns, "trained drift")]
    for name, c in agents.items():
        rate = percent(c.merge_rate, 0)
        values = (c.calls, c.audited, c.identical, c.diverging, c.merged, c.split)
        rows.append((name or "-", *map(str, values), rate, str(c.trained_drift)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]


def call_lines(call: CallAudit) -> list[str]:
    """A diverging call: where it is, and each diverging check with its context."""
    lines = [
        f"rollout {call.rollout_id} · agent {call.agent_name or '-'} · call {call.call_id} "
        f"(sequence {call.sequence_id})"
    ]
    for name, check in (("template", call.template), ("continuation", call.continuation)):
        if check.outcome == "diverges":
            lines += _check_lines(name, check, call.previous_call_id)
    return lines


def _check_lines(name: str, check: Check, previous: str | None) -> list[str]:
    d = check.divergence
    assert d is not None
    if name == "template":
        what = f"the messages rendered ({d.expected_length} tokens)"
    else:
        what = f"call {previous}'s prompt + response ({d.expected_length} tokens)"
    return [
        f"  {name} diverges at position {d.position}: expected {what}, recorded prompt "
        f"{d.recorded_length} tokens",
        f"    {d.marked()}",
        f"    ids: …{list(d.before)} ⟦expected {list(d.expected)} ≠ recorded {list(d.recorded)}⟧",
    ]
