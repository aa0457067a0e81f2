"""The ``voltrl`` command line.

    voltrl dev MODULE:AGENT --data FILE --llm-endpoint URL --model NAME
               [--max-tokens N] [--temperature T] [--top-p P]
    voltrl train CONFIG.yaml
    voltrl runs [--store PATH | --run-dir DIR]
    voltrl serve [--store SPEC] [--host H] [--port N] [--token-file F] [--backend URL ...]
    voltrl gateway --store URL --backend URL [--token-file F] [--host H] [--port N]
    voltrl runner --store URL --agent MODULE:AGENT [--token-file F] [--workers N]
    voltrl model serve PATH|tiny [--host H] [--port N] [--served-name NAME] [--token-file F]

Errors a user can fix (a bad module path, a missing data file, an unreachable endpoint) print
one line on stderr and exit with status 2; no traceback. A run stopped by its failures
(:class:`~voltrl.errors.TooManyFailuresError`, after each distinct error was printed) says so
in one line too and exits with status 1, as ``dev`` does when some rollouts failed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl.errors import (
    AgentLoadError,
    EndpointUnreachableError,
    TooManyFailuresError,
    VoltRLError,
)

if TYPE_CHECKING:
    from voltrl.resources import LLM


def load_agent(spec: str) -> Any:
    """Import ``MODULE:OBJECT`` (a dotted module or a ``.py`` path) and return the agent."""
    from voltrl.agent import LitAgent, rollout

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise AgentLoadError(f"expected MODULE:AGENT (e.g. my_pkg.agents:math_agent), got {spec!r}")
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name)
        if not path.exists():
            raise AgentLoadError(f"agent file {path} does not exist")
        sys.path.insert(0, str(path.parent.resolve()))
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert mod_spec is not None and mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[path.stem] = module
        try:
            mod_spec.loader.exec_module(module)
        except Exception as exc:
            raise AgentLoadError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
    else:
        sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise AgentLoadError(f"cannot import module {module_name!r}: {exc}") from exc
        except Exception as exc:
            raise AgentLoadError(
                f"importing {module_name!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise AgentLoadError(f"module {module_name!r} has no attribute {attr!r}") from None
    if isinstance(obj, type) and issubclass(obj, LitAgent):
        obj = obj()
    if isinstance(obj, LitAgent):
        return obj
    if callable(obj):
        try:
            return rollout(obj)
        except TypeError as exc:
            raise AgentLoadError(str(exc)) from None
    raise AgentLoadError(f"{spec} is a {type(obj).__name__}, not a LitAgent or a function")


def check_endpoint(
    endpoint: str, api_key: str, model: str | None = None, timeout_s: float = 5.0
) -> None:
    """Raise :class:`EndpointUnreachableError` unless something answers at ``endpoint``, and
    :class:`VoltRLError` when its ``/models`` lists models but not ``model``. An endpoint
    without a usable model list (no ``/models``, an answer that is not one) passes."""
    import aiohttp

    async def get_models() -> tuple[int, bytes]:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(
                endpoint.rstrip("/") + "/models", headers={"Authorization": f"Bearer {api_key}"}
            ) as response,
        ):
            return response.status, await response.read()

    def served_models(body: bytes) -> list[str]:
        """The model ids of an OpenAI ``/models`` answer; empty when it is not one."""
        import json

        try:
            data = json.loads(body).get("data")
        except (ValueError, AttributeError):
            return []
        if not isinstance(data, list):
            return []
        return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

    try:
        status, body = asyncio.run(get_models())
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise EndpointUnreachableError(
            f"no OpenAI-compatible endpoint answers at {endpoint} ({type(exc).__name__}: {exc})"
        ) from None
    served = served_models(body) if status == 200 else []
    if model is not None and served and model not in served:
        shown = ", ".join(served[:10]) + (
            f" and {len(served) - 10} more" if len(served) > 10 else ""
        )
        raise VoltRLError(
            f"model {model!r} is not served at {endpoint}; it serves {shown}"
            " (pass one of them to --model)"
        )


def check_llm(llm: LLM, what: str) -> None:
    """:func:`check_endpoint` for an LLM resource before a run (its key from ``api_key_env``
    when it has one); each error starts with ``what``, e.g. "the customer's endpoint"."""
    key = llm.api_key
    if llm.api_key_env:
        key = os.environ.get(llm.api_key_env, "")
        if not key:
            raise VoltRLError(f"{what}: ${llm.api_key_env} (its API key) is not set")
    try:
        check_endpoint(llm.endpoint, key or "EMPTY", llm.model)
    except VoltRLError as e:
        raise VoltRLError(f"{what}: {e}") from None


def _cmd_dev(args: argparse.Namespace) -> int:
    from voltrl.resources import LLM
    from voltrl.runtime import Trainer
    from voltrl.runtime.dataset import load_tasks

    agent = load_agent(args.agent)
    load_tasks(args.data)  # fail on bad data before starting anything
    if not args.skip_endpoint_check:
        check_endpoint(args.llm_endpoint, args.api_key, args.model)
    sampling = {
        "max_tokens": args.max_tokens,
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
    )
    result = trainer.dev(agent, args.data)
    return 0 if result.stats.failed == 0 else 1


def build_from_config(config: dict[str, Any]) -> tuple[Any, Any, str, str | None]:
    """``(trainer, agent, train data, val data)`` from a ``voltrl train`` config.

    The config has ``agent`` (MODULE:AGENT), ``data`` (``train``, optional ``val``: files),
    ``algorithm`` (``name``: ``local_rl``, ``sft`` or ``baseline``, and that algorithm's
    arguments; LocalRL's ``update``, ``trajectory`` and ``warm_start`` (SFT's arguments)
    sections are their configs) and ``trainer``
    (:class:`~voltrl.Trainer` arguments; ``resources`` maps names to LLM fields).
    """
    from voltrl.algorithms.baseline import Baseline
    from voltrl.resources import LLM
    from voltrl.runtime import Trainer

    unknown = set(config) - {"agent", "data", "algorithm", "trainer"}
    if unknown:
        raise VoltRLError(f"unknown config sections {sorted(unknown)}")
    for key in ("agent", "data"):
        if key not in config:
            raise VoltRLError(f"the config needs a {key!r} section")
    data = config["data"]
    if not isinstance(data, dict) or "train" not in data:
        raise VoltRLError("data needs a 'train' file (and optionally 'val')")
    algo_cfg = dict(config.get("algorithm") or {"name": "baseline"})
    name = algo_cfg.pop("name", "baseline")
    try:
        if name == "local_rl":  # its update and trajectory sections are taken as dicts
            from voltrl.algorithms.local import SFT, LocalRL

            if algo_cfg.get("warm_start") is not None:  # a recorded config has it as null
                algo_cfg["warm_start"] = SFT(**algo_cfg["warm_start"])
            algorithm: Any = LocalRL(**algo_cfg)
        elif name == "sft":
            from voltrl.algorithms.local import SFT

            algorithm = SFT(**algo_cfg)
        elif name == "baseline":
            algorithm = Baseline(**algo_cfg)
        else:
            raise VoltRLError(f"unknown algorithm {name!r}; use local_rl, sft or baseline")
        trainer_cfg = dict(config.get("trainer") or {})
        if "resources" in trainer_cfg:
            trainer_cfg["resources"] = {k: LLM(**v) for k, v in trainer_cfg["resources"].items()}
        trainer = Trainer(algorithm, **trainer_cfg)
    except (TypeError, ValueError) as exc:
        raise VoltRLError(f"bad config: {exc}") from None
    return trainer, load_agent(config["agent"]), data["train"], data.get("val")


def _cmd_train(args: argparse.Namespace) -> int:
    import yaml

    path = Path(args.config)
    if not path.exists():
        raise VoltRLError(f"config file {path} does not exist")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise VoltRLError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(config, dict):
        raise VoltRLError(f"{path}: the config must be a mapping")
    trainer, agent, train, val = build_from_config(config)
    result = trainer.fit(agent, train, val)
    # an RL run that ran no rollout did nothing; SFT alone runs none by design
    return 0 if result.stats.rollouts or trainer.algorithm.name == "sft" else 1


def _store_paths(args: argparse.Namespace) -> list[Path]:
    if args.store:
        path = Path(args.store)
        if not path.exists():
            raise VoltRLError(f"store {path} does not exist")
        return [path]
    root = Path(args.run_dir)
    return sorted(root.glob("*/store.sqlite")) if root.exists() else []


def _cmd_runs(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console
    from rich.table import Table

    from voltrl.observability.metrics import summarize
    from voltrl.store.sql import SQLStore

    async def collect() -> list[tuple[Any, ...]]:
        rows = []
        for path in _store_paths(args):
            store = SQLStore(path)
            try:
                for run in await store.list_runs():
                    if _run_shown(run, args):
                        rollouts = await store.query_rollouts(run_id=run.run_id)
                        rows.append((path, run, summarize(rollouts)))
            finally:
                await store.close()
        return rows

    rows = asyncio.run(collect())
    if not rows:
        print(f"no runs found in {args.store or args.run_dir}")
        return 0
    table = Table(title="runs")
    # A long name folds onto more lines rather than being cut short; --wide never wraps.
    table.add_column("name", overflow="fold", min_width=min(20, max(len(r[1].name) for r in rows)))
    columns = ["status", "kind", "started", "rollouts", "reward"]
    for col in columns + (["algorithm", "run id", "store", "error"] if args.wide else []):
        table.add_column(col, overflow="fold")
    for path, run, s in rows:
        reward = "-" if s.reward_mean is None else f"{s.reward_mean:.3f}"
        if args.wide and s.reward_std is not None:
            reward += f" ± {s.reward_std:.3f}"
        started = time.strftime("%m-%d %H:%M", time.localtime(run.created_at))
        rollouts = f"{s.rollouts}" + (f" ({s.failed} failed)" if s.failed else "")
        cells = [run.name, run.status, run.kind, started, rollouts, reward]
        if args.wide:
            cells += [run.algorithm, run.run_id, str(path), run.error or ""]
        table.add_row(*cells)
    Console(width=100_000 if args.wide else None).print(table)
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from voltrl.observability.show import show

    return show(
        args.run,
        args.rollout,
        store=args.store,
        run_dir=args.run_dir,
        token=_token(args),
        full=args.full,
    )


def _run_shown(run: Any, args: argparse.Namespace) -> bool:
    """Whether ``voltrl runs``' filters keep ``run``."""
    return (
        (not args.status or run.status in args.status)
        and (not args.kind or run.kind == args.kind)
        and (not args.name or args.name in run.name)
    )


def _token(args: argparse.Namespace) -> str | None:
    """The bearer token: ``--token``, else the first line of ``--token-file``, else
    ``$VOLTRL_TOKEN``."""
    if args.token:
        return args.token
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise VoltRLError(f"cannot read --token-file: {exc}") from None
        if not token:
            raise VoltRLError(f"--token-file {args.token_file} is empty")
        return token
    return os.environ.get("VOLTRL_TOKEN") or None


def _add_token_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--token-file", default=None, help="file holding the bearer token (or set $VOLTRL_TOKEN)"
    )
    parser.add_argument(
        "--token",
        default=None,
        help="bearer token (visible to other users in ps: prefer the above)",
    )


def _gateway_options(args: argparse.Namespace) -> dict[str, Any]:
    options = {
        "model": args.model,
        "backend_api_key": args.backend_api_key,
        "request_token_ids": not args.no_token_ids,
        "reasoning_split": args.reasoning_split,
    }
    if args.lora_adapter:
        from voltrl.algorithms.local.lora_adapters import LoraAdapters

        pairs = [a.partition("=") for a in args.lora_adapter]
        if any(not sep for _, sep, _ in pairs):
            raise VoltRLError("--lora-adapter takes NAME=REGEX (e.g. writer='write|rewrite')")
        names = [name for name, _, _ in pairs]
        if len(set(names)) < len(names):
            raise VoltRLError(f"--lora-adapter: an adapter is given twice ({', '.join(names)})")
        try:
            routes = LoraAdapters.parse(
                {name: regex for name, _, regex in pairs}, served_name=args.model or ""
            )
        except ValueError as exc:
            raise VoltRLError(f"--lora-adapter: {exc}") from None
        options["model_for_agent"] = routes.adapter_for
    return options


def _gateway_retry(args: argparse.Namespace) -> Any:
    from pydantic import ValidationError

    from voltrl.retry import GatewayRetry

    try:
        return GatewayRetry(
            retries=args.retries,
            backoff_s=args.backoff,
            max_backoff_s=args.max_backoff,
            timeout_s=args.backend_timeout,
            connect_timeout_s=args.connect_timeout,
        )
    except ValidationError as exc:
        raise VoltRLError(f"bad retry settings: {exc}") from None


def _cmd_serve(args: argparse.Namespace) -> int:
    from voltrl._http.serving import run
    from voltrl.cli.serve import run_server

    coro = run_server(
        args.store,
        host=args.host,
        port=args.port,
        token=_token(args),
        backends=args.backend,
        gateway=not args.no_gateway,
        gateway_options=_gateway_options(args),
        retry=_gateway_retry(args),
    )
    run(coro)  # on uvloop when installed
    return 0


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from voltrl._http.serving import run
    from voltrl.observability.dashboard import run_dashboard

    store_token = None
    if args.store_token_file:
        try:
            store_token = Path(args.store_token_file).read_text().strip() or None
        except OSError as exc:
            raise VoltRLError(f"cannot read --store-token-file: {exc}") from None
    coro = run_dashboard(
        args.sources, host=args.host, port=args.port, token=_token(args), store_token=store_token
    )
    run(coro)
    return 0


def _cmd_gateway(args: argparse.Namespace) -> int:
    from voltrl._http.serving import run
    from voltrl.cli.serve import run_gateway

    coro = run_gateway(
        args.store,
        args.backend,
        host=args.host,
        port=args.port,
        token=_token(args),
        gateway_options=_gateway_options(args),
        retry=_gateway_retry(args),
    )
    run(coro)  # on uvloop when installed
    return 0


def _cmd_runner(args: argparse.Namespace) -> int:
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
        agent, args.store, token=_token(args), workers=args.workers, config=config, name=args.name
    )


MODEL_PORT = 8000
"""Port of ``voltrl model serve`` unless ``--port`` says otherwise."""


def _cmd_model_serve(args: argparse.Namespace) -> int:
    from voltrl._http.serving import require_token_off_loopback, run

    token = _token(args)
    require_token_off_loopback(args.host, token)
    if args.max_batch_size < 1:
        raise VoltRLError("--max-batch-size must be at least 1")
    try:
        from voltrl.algorithms.local.engine import Engine
        from voltrl.algorithms.local.threads import use_threads
        from voltrl.algorithms.local.tiny import TINY, load_model
    except ModuleNotFoundError as exc:
        raise VoltRLError(
            f"voltrl model serve needs {exc.name}: pip install 'voltrl[local]'"
        ) from None
    path = Path(args.model)
    if args.model != TINY and not (path / "config.json").is_file():
        problem = "is not a Hugging Face model directory" if path.exists() else "does not exist"
        raise VoltRLError(f"model {args.model} {problem}: give a model directory or 'tiny'")
    try:
        threads = use_threads(args.threads, report=True)
    except ValueError as exc:
        raise VoltRLError(f"--threads: {exc}") from None
    model, tokenizer = load_model(args.model)
    name = args.served_name or (TINY if args.model == TINY else path.resolve().name)
    engine = Engine(model, tokenizer, max_batch_size=args.max_batch_size, threads=threads)
    try:
        key = _token_hint(args) if token else None
        run(_serve_model(engine, args.host, args.port, name, token, key, tiny=args.model == TINY))
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
    *,
    tiny: bool,
) -> None:
    """Serve ``engine`` as ``name``, print how to use it (``key_hint``: how the printed
    command passes the token), and stop on SIGTERM or SIGINT."""
    from voltrl._http.serving import reachable_url, wait_for_signal
    from voltrl.algorithms.local.openai_api import serve_engine

    try:
        url, stop = await serve_engine(engine, host, port, model_name=name, token=token)
    except (OSError, RuntimeError) as exc:
        raise VoltRLError(f"cannot listen on {host}:{port}: {exc}") from None
    endpoint = f"{reachable_url(url)}/v1"
    auth, key = ("bearer token", f" --api-key {key_hint}") if token else ("none", "")
    try:
        print(f"voltrl model serve: model {name} at {endpoint} (OpenAI-compatible; auth: {auth})")
        if tiny:
            print("the tiny model has random weights: rewards stay ~0 (it proves the plumbing)")
        print("run an agent against it (here the quick-start sample, from a clone of the repo):")
        print(
            "  voltrl dev samples/quickstart/agent.py:agent --data samples/quickstart/tasks.jsonl"
            f" --llm-endpoint {endpoint} --model {name}{key}"
        )
        print("Ctrl-C stops it", flush=True)
        await wait_for_signal()
    finally:
        await stop()


def _add_serving_args(parser: argparse.ArgumentParser) -> None:
    from voltrl.cli.serve import DEFAULT_PORT

    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    _add_token_args(parser)
    parser.add_argument("--model", default=None, help="gateway: force this model name")
    parser.add_argument("--backend-api-key", default=None, help="gateway: key for the backends")
    parser.add_argument(
        "--no-token-ids", action="store_true", help="gateway: do not ask backends for token ids"
    )
    parser.add_argument(
        "--lora-adapter",
        action="append",
        metavar="NAME=REGEX",
        help="gateway: send the calls of agents REGEX fully matches to the LoRA adapter NAME "
        "(as the model; first match wins; repeat for each adapter)",
    )
    parser.add_argument(
        "--reasoning-split",
        action="store_true",
        help="gateway: hand agents a model's <think>...</think> as reasoning_content",
    )
    from voltrl.retry import GatewayRetry

    retry = GatewayRetry()
    parser.add_argument(
        "--retries", type=int, default=retry.retries, help="gateway: extra tries per call"
    )
    parser.add_argument(
        "--backoff", type=float, default=retry.backoff_s, help="gateway: first backoff, s"
    )
    parser.add_argument(
        "--max-backoff", type=float, default=retry.max_backoff_s, help="gateway: longest backoff"
    )
    parser.add_argument(
        "--backend-timeout",
        type=float,
        default=retry.timeout_s,
        help="gateway: longest a backend may stay silent in one try, s",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=retry.connect_timeout_s,
        help="gateway: longest a backend connection may take, s",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``voltrl``."""
    parser = argparse.ArgumentParser(
        prog="voltrl", description="VoltRL: run, train and inspect agents trained with RL."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    dev = sub.add_parser("dev", help="run an agent once per task against an endpoint, no training")
    dev.add_argument("agent", help="MODULE:AGENT or path/to/file.py:AGENT")
    dev.add_argument("--data", required=True, help="a .jsonl, .json or .parquet file of tasks")
    dev.add_argument("--llm-endpoint", required=True, help="OpenAI-compatible base URL (…/v1)")
    dev.add_argument("--model", required=True, help="model name to request")
    dev.add_argument("--api-key", default="EMPTY")
    sampling = dev.add_argument_group(
        "sampling", "the LLM's sampling_parameters (agents pass them to their calls)"
    )
    sampling.add_argument("--max-tokens", type=int, default=None)
    sampling.add_argument("--temperature", type=float, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    dev.add_argument("--n-runners", type=int, default=1)
    dev.add_argument("--max-concurrency", type=int, default=4)
    dev.add_argument("--timeout", type=float, default=None, help="per-rollout timeout, seconds")
    dev.add_argument("--store", default=None, help="store path (default: the run directory)")
    dev.add_argument("--run-dir", default="runs")
    dev.add_argument("--name", default=None)
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
    dev.set_defaults(func=_cmd_dev)

    train = sub.add_parser("train", help="train an agent as a YAML config says")
    train.add_argument("config", help="YAML: agent, data, algorithm, trainer")
    train.set_defaults(func=_cmd_train)

    runs = sub.add_parser("runs", help="list runs and their reward statistics")
    runs.add_argument("--store", default=None, help="a store.sqlite file")
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
    runs.set_defaults(func=_cmd_runs)

    show = sub.add_parser("show", help="one run (rollouts, metric curves) or one of its rollouts")
    show.add_argument(
        "run", metavar="RUN", help="a run name or run id (of several runs named so: the latest)"
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
    _add_token_args(show)
    show.add_argument(
        "--full", action="store_true", help="fold nothing: whole messages, tracebacks, spans"
    )
    show.set_defaults(func=_cmd_show)

    serve = sub.add_parser("serve", help="serve a store (and a gateway) over HTTP")
    serve.add_argument(
        "--store", default="runs/store.sqlite", help="a SQLite path, sqlite:///, postgresql://"
    )
    serve.add_argument(
        "--backend", action="append", default=[], help="inference backend URL (…/v1); repeatable"
    )
    serve.add_argument("--no-gateway", action="store_true", help="serve the store only")
    _add_serving_args(serve)
    serve.set_defaults(func=_cmd_serve)

    dashboard = sub.add_parser(
        "dashboard", help="runs, rollouts, LLM calls and tokens in the browser"
    )
    dashboard.add_argument(
        "sources",
        nargs="*",
        default=["runs"],
        help="run directories, a directory of them (default: runs), store files, or store "
        "URLs (http://, postgresql://)",
    )
    dashboard.add_argument("--host", default="127.0.0.1", help="interface to bind")
    dashboard.add_argument("--port", type=int, default=8500, help="port (default: 8500)")
    dashboard.add_argument(
        "--store-token-file",
        default=None,
        help="file holding the token of a store server among the sources",
    )
    _add_token_args(dashboard)
    dashboard.set_defaults(func=_cmd_dashboard)

    gateway = sub.add_parser("gateway", help="serve a gateway recording into a store server")
    gateway.add_argument("--store", required=True, help="store server URL (http://HOST:PORT)")
    gateway.add_argument(
        "--backend", action="append", required=True, help="inference backend URL; repeatable"
    )
    _add_serving_args(gateway)
    gateway.set_defaults(func=_cmd_gateway)

    runner = sub.add_parser("runner", help="run rollouts for a store server, on any machine")
    runner.add_argument("--store", required=True, help="store server URL (http://HOST:PORT)")
    _add_token_args(runner)
    runner.add_argument("--agent", required=True, help="MODULE:AGENT or path/to/file.py:AGENT")
    runner.add_argument("--workers", type=int, default=1, help="worker processes")
    runner.add_argument("--max-concurrency", type=int, default=4, help="rollouts per worker")
    runner.add_argument("--lease", type=float, default=30.0, help="claim lease, seconds")
    runner.add_argument(
        "--grace", type=float, default=30.0, help="on SIGTERM, seconds to finish in-flight work"
    )
    runner.add_argument("--timeout", type=float, default=None, help="default rollout timeout, s")
    runner.add_argument("--name", default=None, help="worker id prefix (default: host-pid)")
    runner.set_defaults(func=_cmd_runner)

    model = sub.add_parser("model", help="models to try agents against")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    model_serve = model_sub.add_parser(
        "serve",
        help="serve a local model directory or the built-in tiny model, OpenAI-compatible",
    )
    model_serve.add_argument(
        "model",
        metavar="PATH|tiny",
        help="a local Hugging Face model directory, or tiny (built in, random weights)",
    )
    model_serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default loopback)"
    )
    model_serve.add_argument("--port", type=int, default=MODEL_PORT, help="0 picks a free port")
    model_serve.add_argument(
        "--served-name", default=None, help="model name (default: tiny, or the directory name)"
    )
    model_serve.add_argument(
        "--max-batch-size", type=int, default=64, help="sequences decoded together"
    )
    model_serve.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: $OMP_NUM_THREADS, else half the usable CPUs)",
    )
    _add_token_args(model_serve)
    model_serve.set_defaults(func=_cmd_model_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except VoltRLError as exc:
        message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"voltrl: error: {message}", file=sys.stderr)
        return 1 if isinstance(exc, TooManyFailuresError) else 2
    except KeyboardInterrupt:
        print("voltrl: interrupted", file=sys.stderr)
        return 130
