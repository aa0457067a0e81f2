"""Helpers the tests share: a rollout context to activate by hand, a trainer against the fake
backend, the adapter tests' two rollouts of an agent that adds 17 and 25 with a tool, and a
sample's module imported by path."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from fake_openai_backend import FakeBackend, scripted_ids, tool_then_answer

import voltrl as vl
from voltrl._http.serving import serve, serve_in_thread
from voltrl.cli import main
from voltrl.gateway import Gateway
from voltrl.store.base import Store
from voltrl.tracing import RolloutContext
from voltrl.types import Task

TESTS = Path(__file__).resolve().parent
"""The tests' root: the agents and helpers test files share live here."""
ROOT = TESTS.parent
"""The repository."""

ADD_ARGS = '{"a": 17, "b": 25}'
"""The tool call's arguments in :func:`dev_adding_twice`'s script."""


def voltrl(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``voltrl ARGS`` run to its end in ``cwd``, output captured, without colour and 200
    columns wide."""
    return subprocess.run(
        [sys.executable, "-m", "voltrl.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"},
    )


def voltrl_here(
    *args: str, cwd: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> subprocess.CompletedProcess[str]:
    """``voltrl ARGS`` as :func:`voltrl` runs it, but in this test's process, which has torch
    and transformers imported already (a ``voltrl train`` process spends seconds on that): for
    tests of what a command does, not of its process."""

    monkeypatch.chdir(cwd)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = run_main(main, *args, capsys=capsys)
    return subprocess.CompletedProcess(["voltrl", *args], code, out, err)


async def recorded_calls(path: Path) -> list[Any]:
    """Every LLM call in the SQLite store at ``path``, rollout by rollout."""
    from voltrl.store.sql import SQLStore

    store = SQLStore(path)
    try:
        return [
            c for r in await store.query_rollouts() for c in await store.get_llm_calls(r.rollout_id)
        ]
    finally:
        await store.close()


def run_main(
    main: Callable[[list[str]], int], *args: str, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    """A script's ``main(args)`` in this process: its exit status (argparse's usage errors
    give 2), stdout and stderr. For checks of what a command says, where starting a Python
    process with the script's imports (seconds) is not what the test is about."""
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def context(rollout_id: str, attempt_id: str | None = None) -> RolloutContext:
    """A training rollout's context with no task input and no resources (the attempt id is
    ``at-<rollout_id>`` unless given)."""
    return RolloutContext(
        rollout_id=rollout_id,
        attempt_id=attempt_id or f"at-{rollout_id}",
        task=Task(input={}),
        mode="train",
        resources=vl.Resources(items={}),
    )


def fake_trainer(store: Store, run_dir: Path, llm: vl.LLM, **options: Any) -> vl.Trainer:
    """One inline runner recording into ``store``, ``llm`` as ``main_llm``; ``options`` are
    further :class:`voltrl.Trainer` arguments (or replace these)."""
    settings: dict[str, Any] = {"n_runners": 1, "inline": True, "progress": False, **options}
    return vl.Trainer(store=store, run_dir=run_dir, resources={"main_llm": llm}, **settings)


async def dev_adding_twice(agent: Any, store: Store, run_dir: Path) -> vl.RunResult:
    """Run ``agent`` on "What is 17 + 25?" twice at once in a runner process, against a backend
    that calls the tool with :data:`ADD_ARGS` and then answers 42 (at temperature 0.7); checks
    that both rollouts are rewarded and their two calls stored with token ids, as ``solver``."""
    async with FakeBackend() as fb:
        fb.script = tool_then_answer(ADD_ARGS, "42")
        llm = vl.LLM(endpoint=fb.url, model="m", sampling_parameters={"temperature": 0.7})
        trainer = fake_trainer(store, run_dir, llm, inline=False, max_concurrency=2)
        rows = [{"question": "What is 17 + 25?", "answer": 42}] * 2
        result = await trainer.dev_async(agent, rows)

    assert result.rewards == [1.0, 1.0]
    assert {r["body"]["temperature"] for r in fb.requests} == {0.7}
    for rollout in result.rollouts:
        calls = await store.get_llm_calls(rollout.rollout_id)
        assert [c.response_token_ids for c in calls] == [
            scripted_ids(ADD_ARGS),
            scripted_ids("42"),
        ]
        assert {c.agent_name for c in calls} == {"solver"}
        assert all(c.prompt_token_ids for c in calls)
    return result


SAMPLES = Path(__file__).resolve().parents[1] / "samples"


def load_sample(sample: str, name: str) -> ModuleType:
    """``samples/<sample>/<name>.py``, imported by path as ``<sample>_<name>`` (so two samples'
    ``agent.py`` stay apart); the sample's directory goes on ``sys.path`` first, for the
    siblings it imports by name."""
    directory = SAMPLES / sample
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    spec = importlib.util.spec_from_file_location(f"{sample}_{name}", directory / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pydantic look their module up there
    spec.loader.exec_module(module)
    return module


@contextlib.asynccontextmanager
async def serve_gateway(
    gateway: Gateway, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[str]:
    """Serve ``gateway.app`` without a token on this event loop; yields its base URL
    (``http://host:port``). On exit the server stops and :meth:`Gateway.aclose` runs. (Runs
    serve their gateways with :func:`voltrl.gateway.start_gateway`, behind the run's token.)"""
    url, stop = await serve(gateway.app, host, port)
    try:
        yield url
    finally:
        await stop()
        await gateway.aclose()


@contextlib.contextmanager
def FakeBackendProcess(*args: str) -> Iterator[str]:
    """The fake OpenAI backend (``tests/fake_openai_backend.py ARGS``) in a process of its own,
    on a port the OS picks, for tests whose event loop is blocked by a subprocess or that stop
    processes with signals; yields its ``/v1`` URL once it listens."""
    script = Path(__file__).with_name("fake_openai_backend.py")
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "serving URL" once it listens; "" if it died
        if not line.startswith("serving "):
            raise RuntimeError(f"the fake backend did not start (exit {proc.wait(10)})")
        yield line.split()[1]
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def chatml_ids(fb: FakeBackend) -> None:
    """Make ``fb``'s token ids those LocalRL's engine would record: prompts rendered with the
    tiny model's chat template (Qwen2.5-style ChatML, Hermes tool calls), replies encoded as
    the model would write them (``<tool_call>{...}</tool_call>``, then ``<|im_end|>``)."""
    from voltrl.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()

    def prompt(req: dict) -> list[int]:
        text = tok.apply_chat_template(
            req["messages"], tools=req.get("tools"), add_generation_prompt=True, tokenize=False
        )
        return tok.encode(text, add_special_tokens=False)

    def reply(r: dict) -> list[int]:
        text = r.get("text") or (
            f'<tool_call>\n{{"name": "{r["tool"]}", "arguments": {r["arguments"]}}}\n</tool_call>'
        )
        return tok.encode(text + "<|im_end|>", add_special_tokens=False)

    fb.prompt_ids, fb.reply_ids = prompt, reply


class Served:
    """A ``voltrl model serve`` process (``command``: another serving command, ``("teacher",
    "serve")``), run in ``cwd``, and the lines it printed up to "Ctrl-C stops it"."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        command: tuple[str, ...] = ("model", "serve"),
        cwd: Path | None = None,
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "voltrl.cli", *command, *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**{k: v for k, v in os.environ.items() if k != "VOLTRL_TOKEN"}, **(env or {})},
        )
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(lines,), daemon=True).start()
        self.lines: list[str] = []
        deadline = time.monotonic() + 120
        while not self.lines or not self.lines[-1].startswith("Ctrl-C"):
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"the server exited: {self.proc.wait()}, {self.stderr()}")
            self.lines.append(line.rstrip("\n"))
        self.endpoint = re.findall(r" at (http://\S+/v1) ", "\n".join(self.lines))[0]

    def _read(self, lines: queue.Queue[str | None]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            lines.put(line)
        lines.put(None)

    def stderr(self) -> str:
        assert self.proc.stderr is not None
        return self.proc.stderr.read()

    def stop(self, sig: signal.Signals = signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(30)


def tensorboard_events(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def version_labels(root: Path, run_id: str | None = None) -> list[str]:
    """What the dashboard over ``root`` says each resources version of a run was (its run
    page's "in the run" column); ``run_id``: the run's, else the first listed."""
    import httpx

    from voltrl.observability.dashboard import Catalog, dashboard_app

    with (
        serve_in_thread(dashboard_app(Catalog([root]))) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        if run_id is None:
            found = re.search(r'data-run-id="([^"]+)"', client.get("/").text)
            assert found is not None, "no run listed"
            run_id = found.group(1)
        page = client.get(f"/runs/{run_id}").text
    return re.findall(r'<td class="what">([^<]*)</td>', page)
