"""Run the agent service sample: the OpenAI Agents SDK agent in its own FastAPI process, the
trainer posting tasks to it. ``dev`` runs it against any OpenAI-compatible endpoint; ``train``
trains the model it uses with LocalRL on this machine.

    python samples/agent_service/run.py dev --endpoint http://127.0.0.1:8000/v1 --model NAME
    python samples/agent_service/run.py train                  # the tiny built-in model, 2 steps
    python samples/agent_service/run.py train --model Qwen/Qwen2.5-0.5B-Instruct --steps 50
    python samples/agent_service/run.py train --loggers tensorboard  # also to TensorBoard

Both start ``service.py`` as a subprocess (or use ``--service-url`` of one already running,
whose ``VOLTRL_GATEWAY_FILE`` must be ``--gateway-file``), wait until it is healthy, and run
the trainer with :class:`client.ServiceAgent`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import sample_cli as cli  # noqa: E402
from client import ServiceAgent  # noqa: E402
from service import GATEWAY_FILE_ENV  # noqa: E402
from units import make_tasks  # noqa: E402

import voltrl as vl  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def service_process(gateway_file: Path, *, startup_s: float = 120.0) -> Iterator[str]:
    """Start ``service.py`` on a free loopback port, reading ``gateway_file``; yields its URL
    once ``/health`` answers, and stops it on exit."""
    port = _free_port()
    env = {**os.environ, GATEWAY_FILE_ENV: str(gateway_file)}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "service.py"), "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read() if proc.stdout else ""
                raise RuntimeError(f"the agent service exited with {proc.returncode}:\n{out}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the agent service did not start within {startup_s:.0f} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@contextlib.contextmanager
def agent_for(args: argparse.Namespace, run_dir: Path) -> Iterator[ServiceAgent]:
    """The trainer-side agent, talking to ``--service-url`` or to a service started here."""
    gateway_file = args.gateway_file or run_dir / "gateway.json"
    if args.service_url:
        yield ServiceAgent(args.service_url, gateway_file)
        return
    with service_process(gateway_file) as url:
        yield ServiceAgent(url, gateway_file)


def datasets(seed: int, n_train: int, n_val: int) -> tuple[list[dict], list[dict]]:
    """Training and held-out tasks from ``seed``, no question in both."""
    return cli.held_out_split(make_tasks, seed, n_train, n_val)


def dev(args: argparse.Namespace) -> vl.RunResult:
    """Run the agent once per task against ``--endpoint``, no training."""
    _, tasks = datasets(args.seed, 0, args.n)
    name = cli.run_name(args, "agent_service-dev")
    with agent_for(args, args.run_dir / name) as agent:
        result = cli.dev_run(args, agent, name, tasks)
    print(f"solved {result.stats.reward_mean or 0.0:.1%} of {len(tasks)}; run in {result.run_dir}")
    return result


def train(args: argparse.Namespace) -> vl.RunResult:
    """Train the service agent's model with LocalRL, validating before and after."""
    train_rows, val_rows = datasets(args.seed, 500, args.n_val)
    algorithm = cli.local_rl(args)
    name = cli.run_name(args, "agent_service-train")
    with agent_for(args, args.run_dir / name) as agent:
        return cli.train_run(args, algorithm, agent, name, train_rows, val_rows)


def main(argv: list[str] | None = None) -> int:
    parser, sub = cli.sample_parser(__doc__)
    common = cli.common_arguments("task")
    common.add_argument("--service-url", help="use this running service instead of starting one")
    common.add_argument(
        "--gateway-file",
        type=Path,
        help=f"where to publish the gateway (the service's ${GATEWAY_FILE_ENV}); "
        "default: gateway.json in the run directory",
    )
    cli.add_commands(sub, common, "tasks", dev=dev, train=train)
    return cli.main_with(parser, argv, cli.run_command)


if __name__ == "__main__":
    raise SystemExit(main())
