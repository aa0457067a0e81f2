"""``voltrl runner``: run rollouts for a store server, on any machine."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from voltrl.cli.agents import load_agent
from voltrl.cli.options import add_token_args, bearer_token
from voltrl.errors import VoltRLError

if TYPE_CHECKING:
    from voltrl.cli.options import Subparsers


def register(sub: Subparsers) -> None:
    """Add ``voltrl runner`` to the ``voltrl`` parser."""
    runner = sub.add_parser("runner", help="run rollouts for a store server, on any machine")
    runner.add_argument("--store", required=True, help="store server URL (http://HOST:PORT)")
    add_token_args(runner)
    runner.add_argument("--agent", required=True, help="MODULE:AGENT or path/to/file.py:AGENT")
    runner.add_argument("--workers", type=int, default=1, help="worker processes")
    runner.add_argument("--max-concurrency", type=int, default=4, help="rollouts per worker")
    runner.add_argument("--lease", type=float, default=30.0, help="claim lease, seconds")
    runner.add_argument(
        "--grace", type=float, default=30.0, help="on SIGTERM, seconds to finish in-flight work"
    )
    runner.add_argument("--timeout", type=float, default=None, help="default rollout timeout, s")
    runner.add_argument("--name", default=None, help="worker id prefix (default: host-pid)")
    runner.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    from voltrl.runtime.runner import RunnerConfig
    from voltrl.runtime.workers import run_runner

    if not args.store.startswith(("http://", "https://")):
        raise VoltRLError(
            f"--store must be a store server URL (http://HOST:PORT), got {args.store}"
        )
    if args.workers < 1 or args.max_concurrency < 1:
        raise VoltRLError("--workers and --max-concurrency must be at least 1")
    config = RunnerConfig(
        max_concurrency=args.max_concurrency,
        lease_s=args.lease,
        claim_wait_s=min(5.0, args.lease),
        default_timeout_s=args.timeout,
        grace_s=args.grace,
    )
    agent = load_agent(args.agent)
    return run_runner(
        agent,
        args.store,
        token=bearer_token(args),
        workers=args.workers,
        config=config,
        name=args.name,
    )
