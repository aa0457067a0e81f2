"""What agents, models and users wrote reaches the console as text: escape sequences are shown
escaped (never sent to the terminal), and bracketed text (``[/INST]``) is never read as rich
markup, in every console writer: the trainer's failure report and summary, ``voltrl runs``,
``voltrl show`` and the CLI's error lines."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fake_openai_backend import FakeBackend
from helpers import FakeBackendProcess, voltrl, voltrl_here

import voltrl as vl
from voltrl.store.sql import SQLStore
from voltrl.types import AttemptResult, Reward, Run, Task

ESC = "\x1b]0;pwned\x07\x1b[2J"  # retitles the terminal and clears the screen if sent raw
BRACKETS = "[/INST] [bold]not bold[/bold] [/]"


def assert_shown_as_text(output: str) -> None:
    assert "\x1b" not in output and "\x07" not in output, repr(output)
    assert "\\x1b" in output  # the escape is shown, written out
    assert "[/INST]" in output  # brackets shown as typed, not eaten as markup


@vl.rollout
async def raising_agent(task: dict, llm: vl.LLM) -> float:
    raise RuntimeError(f"model said {ESC} {BRACKETS}")


async def test_the_failure_report_prints_an_agents_error_as_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with FakeBackend() as backend:
        trainer = vl.Trainer(
            resources={"main_llm": vl.LLM(endpoint=backend.url, model="m")},
            run_dir=tmp_path,
            name="raising",
            inline=True,
            progress=False,
        )
        with pytest.raises(vl.TooManyFailuresError):
            await trainer.dev_async(raising_agent, [{"q": 1}])
    out = capsys.readouterr()
    assert "rollout error" in out.out + out.err
    assert_shown_as_text(out.out + out.err)


def store_with_a_hostile_run(path: Path) -> str:
    """A SQLite store holding a failed run whose name, error and a reward's name carry escape
    sequences and bracketed text (a store server accepts any name); returns the rollout id."""

    async def write() -> str:
        store = SQLStore(path)
        try:
            error = f"failed: {ESC} {BRACKETS}"
            run = Run(name=f"run {BRACKETS}", kind="dev", status="failed", error=error)
            run = await store.add_run(run)
            [rollout] = await store.enqueue([Task(input={"q": ESC})], run_id=run.run_id)
            claim = await store.claim("w")
            assert claim is not None
            reward = Reward(
                rollout_id=rollout.rollout_id,
                attempt_id=claim.attempt.attempt_id,
                value=1.0,
                name=f"judge {ESC} {BRACKETS}",
                metadata={"why": f"{ESC} {BRACKETS}"},
            )
            result = AttemptResult(status="succeeded", reward=1.0, rewards=[reward])
            await store.complete(claim.attempt.attempt_id, result)
            return rollout.rollout_id
        finally:
            await store.close()

    return asyncio.run(write())


@pytest.mark.slow
def test_voltrl_runs_prints_hostile_names_and_errors_as_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    here = {"cwd": tmp_path, "capsys": capsys, "monkeypatch": monkeypatch}
    store = tmp_path / "store.sqlite"
    store_with_a_hostile_run(store)
    for wide in ([], ["--wide"]):
        out = voltrl_here("runs", "--store", str(store), *wide, **here)
        assert out.returncode == 0, out.stderr  # rich raised MarkupError on "[/INST]"
        assert "[/INST]" in out.stdout
        assert "\x1b" not in out.stdout
    wide = voltrl_here("runs", "--store", str(store), "--wide", **here)
    assert_shown_as_text(wide.stdout)


@pytest.mark.slow
def test_voltrl_show_prints_a_rewards_name_and_the_task_as_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    here = {"cwd": tmp_path, "capsys": capsys, "monkeypatch": monkeypatch}
    store = tmp_path / "store.sqlite"
    rollout_id = store_with_a_hostile_run(store)
    run = voltrl_here("show", "--store", str(store), f"run {BRACKETS}", **here)
    assert run.returncode == 0, run.stderr
    assert_shown_as_text(run.stdout)
    shown = voltrl_here("show", "--store", str(store), f"run {BRACKETS}", rollout_id, **here)
    assert shown.returncode == 0, shown.stderr
    assert "judge" in shown.stdout
    assert_shown_as_text(shown.stdout)


@pytest.mark.slow
def test_a_cli_error_line_prints_the_message_as_text(tmp_path: Path) -> None:
    # `voltrl dev` of an agent that raises: the run stops, and its error line quotes the error
    agent = tmp_path / "raising.py"
    agent.write_text(
        "import voltrl as vl\n\n"
        "@vl.rollout\n"
        "async def agent(task, llm):\n"
        f"    raise RuntimeError({f'model said {ESC} {BRACKETS}'!r})\n"
    )
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"q": 1}\n')
    with FakeBackendProcess() as url:
        out = voltrl(
            "dev",
            f"{agent}:agent",
            "--data",
            str(data),
            "--llm-endpoint",
            url,
            "--model",
            "fake-model",
            "--run-dir",
            str(tmp_path / "runs"),
            cwd=tmp_path,
        )
    assert out.returncode == 1, out.stderr
    assert "voltrl: error:" in out.stderr
    assert_shown_as_text(out.stdout + out.stderr)
