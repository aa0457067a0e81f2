"""``voltrl teacher serve MODULE:FUNCTION``: a Python policy function served as an
OpenAI-compatible teacher (:mod:`voltrl.serving.teacher`), to record its episodes with ``dev``
and warm a model up on them before RL."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from voltrl.cli.options import add_token_args, bearer_token

if TYPE_CHECKING:
    from starlette.types import ASGIApp

    from voltrl.cli.options import Subparsers

TEACHER_PORT = 8001
"""Port of ``voltrl teacher serve`` unless ``--port`` says otherwise."""


def register(sub: Subparsers) -> None:
    """Add ``voltrl teacher serve`` to the ``voltrl`` parser."""
    teacher = sub.add_parser("teacher", help="a scripted teacher to warm a model up on")
    teacher_sub = teacher.add_subparsers(dest="teacher_command", required=True)
    serve = teacher_sub.add_parser(
        "serve",
        help="serve a Python policy function (messages, tools -> a reply or tool calls) as an "
        "OpenAI-compatible chat-completions endpoint",
    )
    serve.add_argument(
        "policy",
        metavar="MODULE:FUNCTION",
        help="the policy: a dotted module or a .py file, and the function in it "
        "(my_teacher.py:policy)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    serve.add_argument("--port", type=int, default=TEACHER_PORT, help="0 picks a free port")
    serve.add_argument(
        "--seed", type=int, default=0, help="seeds each episode's rng (default %(default)s)"
    )
    serve.add_argument(
        "--served-name", default="teacher", help="the model name it reports (default teacher)"
    )
    add_token_args(serve)
    serve.set_defaults(func=_serve_command)


def _serve_command(args: argparse.Namespace) -> int:
    from voltrl._http.serving import check_bindable, require_token_off_loopback, run
    from voltrl.serving.teacher import load_policy, teacher_app

    token = bearer_token(args)
    require_token_off_loopback(args.host, token)
    check_bindable(args.host, args.port)
    app = teacher_app(load_policy(args.policy), seed=args.seed, model=args.served_name, token=token)
    run(_serve(app, args, token is not None))
    return 0


async def _serve(app: ASGIApp, args: argparse.Namespace, with_token: bool) -> None:
    """Serve ``app``, print how to use it, and stop on SIGTERM or SIGINT."""
    from voltrl._http.serving import reachable_url, served, wait_for_signal

    async with served(app, args.host, args.port, graceful_s=2.0) as url:
        endpoint = f"{reachable_url(url)}/v1"
        auth = "bearer token" if with_token else "none"
        print(
            f"voltrl teacher serve: {args.policy} at {endpoint} as model {args.served_name} "
            f"(OpenAI-compatible; auth: {auth})"
        )
        print(
            "record its episodes without token ids, like a hosted API's: "
            "voltrl dev AGENT --data FILE --llm-endpoint "
            f"{endpoint} --model {args.served_name} --no-token-ids"
        )
        print("Ctrl-C stops it", flush=True)
        await wait_for_signal()
