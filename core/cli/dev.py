"""``voltrl dev``: run an agent once per task against an endpoint, no training."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from voltrl.cli.agents import load_agent
from voltrl.cli.endpoints import check_endpoint
from voltrl.cli.model import DEFAULT_MAX_TOKENS
from voltrl.cli.options import add_loggers_arg
from voltrl.errors import VoltRLError

if TYPE_CHECKING:
    from voltrl.cli.options import Subparsers


def register(sub: Subparsers) -> None:
    """Add ``voltrl dev`` to the ``voltrl`` parser."""
    dev = sub.add_parser("dev", help="run an agent once per task against an endpoint, no training")
    dev.add_argument("agent", help="MODULE:AGENT or path/to/file.py:AGENT")
    dev.add_argument("--data", required=True, help="a .jsonl, .json or .parquet file of tasks")
    dev.add_argument("--llm-endpoint", required=True, help="OpenAI-compatible base URL (…/v1)")
    dev.add_argument("--model", required=True, help="model name to request")
    dev.add_argument("--api-key", default="EMPTY")
    sampling = dev.add_argument_group(
        "sampling",
        "the LLM's sampling_parameters: agents may pass them to their calls, and the run's "
        "gateway fills them into calls that leave them out",
    )
    sampling.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="caps each reply (default %(default)s; 0: no cap)",
    )
    sampling.add_argument("--temperature", type=float, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    dev.add_argument("--n-runners", type=int, default=1)
    dev.add_argument("--max-concurrency", type=int, default=4)
    dev.add_argument("--timeout", type=float, default=None, help="per-rollout timeout, seconds")
    dev.add_argument("--store", default=None, help="store path (default: the run directory)")
    dev.add_argument("--run-dir", default="runs")
    dev.add_argument("--name", default=None)
    add_loggers_arg(dev)
    dev.add_argument("--inline", action="store_true", help="run workers in this process")
    dev.add_argument(
        "--skip-endpoint-check",
        action="store_true",
        help="do not check that the endpoint answers and serves --model",
    )
    dev.add_argument(
        "--no-token-ids",
        action="store_true",
        help="do not ask the endpoint for token ids (hosted APIs that reject the field)",
    )
    dev.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    """Run ``voltrl dev``; 1 when some rollouts failed."""
    from voltrl.resources import LLM
    from voltrl.runtime import Trainer
    from voltrl.runtime.dataset import load_tasks

    agent = load_agent(args.agent)
    load_tasks(args.data)  # fail on bad data before starting anything
    if not args.skip_endpoint_check:
        check_endpoint(args.llm_endpoint, args.api_key, args.model)
    if args.max_tokens < 0:
        raise VoltRLError("--max-tokens must be at least 0 (0: no cap)")
    sampling = {
        "max_tokens": args.max_tokens or None,
        "temperature": args.temperature,
        "top_p": args.top_p,
    }
    llm = LLM(
        endpoint=args.llm_endpoint,
        model=args.model,
        api_key=args.api_key,
        sampling_parameters={k: v for k, v in sampling.items() if v is not None},
    )
    trainer = Trainer(
        request_token_ids=not args.no_token_ids,
        n_runners=args.n_runners,
        store=args.store,
        resources={"main_llm": llm},
        run_dir=args.run_dir,
        name=args.name,
        max_concurrency=args.max_concurrency,
        rollout_timeout_s=args.timeout,
        inline=args.inline,
        loggers=args.loggers,
    )
    cap = f"at most {args.max_tokens} tokens" if args.max_tokens else "no cap"
    print(f"voltrl dev: a call that sets no max_tokens gets {cap} (--max-tokens)", flush=True)
    result = trainer.dev(agent, args.data)
    return 0 if result.stats.failed == 0 else 1
