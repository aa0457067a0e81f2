"""Run the agent service sample: the OpenAI Agents SDK agent in its own FastAPI process, the
trainer posting tasks to it. ``dev`` runs it against any OpenAI-compatible endpoint; ``train``
trains the model it uses with LocalRL on this machine.

    python samples/agent_service/run.py dev --endpoint http://127.0.0.1:8000/v1 --model NAME
    python samples/agent_service/run.py train                  # the tiny built-in model, 2 steps
    python samples/agent_service/run.py train --model Qwen/Qwen2.5-0.5B-Instruct --steps 50

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
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

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
    val = make_tasks(n_val, seed=10_000 + seed)
    held_out = {row["question"] for row in val}
    train = [r for r in make_tasks(n_train, seed=seed) if r["question"] not in held_out]
    return train, val


def dev(args: argparse.Namespace) -> vl.RunResult:
    """Run the agent once per task against ``--endpoint``, no training."""
    _, tasks = datasets(args.seed, 0, args.n)
    sampling = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    llm = vl.LLM(
        endpoint=args.endpoint, model=args.model, api_key=args.api_key, sampling_parameters=sampling
    )
    name = "agent_service-dev"
    with agent_for(args, args.out / name) as agent:
        trainer = vl.Trainer(
            n_runners=1,
            max_concurrency=args.concurrency,
            resources={"main_llm": llm},
            run_dir=args.out,
            name=name,
            request_token_ids=not args.no_token_ids,
        )
        result = trainer.dev(agent, tasks)
    print(f"solved {result.stats.reward_mean or 0.0:.1%} of {len(tasks)}; run in {result.run_dir}")
    return result


def local_model(name: str | None, seed: int) -> dict[str, Any]:
    """``LocalRL``'s ``model`` (and ``tokenizer``): a path or hub name, else the tiny model."""
    if name:
        return {"model": name}
    from voltrl.algorithms.local.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    return {"model": build_tiny_model(tokenizer, hidden=128, seed=seed), "tokenizer": tokenizer}


def train(args: argparse.Namespace) -> vl.RunResult:
    """Train the service agent's model with LocalRL, validating before and after."""
    from voltrl.trajectory import TrajectoryConfig

    train_rows, val_rows = datasets(args.seed, 500, args.n_val)
    sampling = {"temperature": 1.0, "max_tokens": args.max_tokens}
    algorithm = vl.LocalRL(
        **local_model(args.model, args.seed),
        steps=args.steps,
        tasks_per_step=args.tasks_per_step,
        group_size=args.group_size,
        sampling=sampling,
        val_sampling={**sampling, "temperature": 0.0},
        val_every=args.steps,
        trajectory=TrajectoryConfig(mode="trajectory"),
        seed=args.seed,
    )
    name = "agent_service-train"
    with agent_for(args, args.out / name) as agent:
        trainer = vl.Trainer(
            algorithm,
            n_runners=1,
            max_concurrency=args.concurrency,
            run_dir=args.out,
            name=name,
        )
        result = trainer.fit(agent, train_rows, val_rows)
    val = [h["val/reward_mean"] for h in algorithm.history if "val/reward_mean" in h]
    if val:
        print(f"held-out reward: {val[0]:.1%} before, {val[-1]:.1%} after; run in {result.run_dir}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--seed", type=int, default=0, help="task generation seed")
    common.add_argument("--out", type=Path, default=Path("runs"), help="run directory root")
    common.add_argument("--concurrency", type=int, default=8, help="rollouts at a time")
    common.add_argument("--service-url", help="use this running service instead of starting one")
    common.add_argument(
        "--gateway-file",
        type=Path,
        help=f"where to publish the gateway (the service's ${GATEWAY_FILE_ENV}); "
        "default: gateway.json in the run directory",
    )

    d = sub.add_parser("dev", parents=[common], help="run the agent against an endpoint")
    d.add_argument("--endpoint", required=True, help="OpenAI-compatible base URL (.../v1)")
    d.add_argument("--model", required=True, help="model name the endpoint serves")
    d.add_argument("--api-key", default="EMPTY")
    d.add_argument("--n", type=int, default=16, help="tasks to run")
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--max-tokens", type=int, default=512)
    d.add_argument(
        "--no-token-ids",
        action="store_true",
        help="do not ask the endpoint for token ids (hosted APIs that reject the field)",
    )
    d.set_defaults(run=dev)

    t = sub.add_parser("train", parents=[common], help="train with LocalRL on this machine")
    t.add_argument("--model", help="model path or hub name (default: the tiny random model)")
    t.add_argument("--steps", type=int, default=2, help="policy updates")
    t.add_argument("--tasks-per-step", type=int, default=4)
    t.add_argument("--group-size", type=int, default=4)
    t.add_argument("--n-val", type=int, default=8, help="held-out tasks")
    t.add_argument("--max-tokens", type=int, default=64)
    t.set_defaults(run=train)

    args = parser.parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
