"""The real-model recipe of ``docs/own_agent_real_model.md`` runs as written: its four files
(the code blocks titled ``convert_agent.py``, ``test_convert_agent.py``, ``convert_teacher.py``
and ``train.py``) are copied out of the page into a folder and run there: the reward's tests
pass, the offline look at the teacher prints what the page says, and ``train.py`` runs with
the settings the page gives to try the plumbing first (the built-in tiny model, 2 warm-up
steps, 1 RL step); the shell's ``voltrl teacher serve`` answers the page's client snippet and
its plumbing check (``voltrl dev`` on a few tasks). ``make test-real`` runs the
same files on SmolLM2 (``tests_real/test_docs_recipe_smollm2.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, Served

PAGE = ROOT / "docs" / "own_agent_real_model.md"
FILES = ("convert_agent.py", "test_convert_agent.py", "convert_teacher.py", "train.py")
TRY_THE_PLUMBING = {"MODEL": '"tiny"', "SFT_STEPS": "2", "RL_STEPS": "1"}
"""The settings the page gives to try the plumbing first."""


def code_blocks(page: Path = PAGE) -> list[tuple[str, str, str]]:
    """``(language, title, code)`` of each fenced code block of ``page`` (title: ``""`` when
    the block has none)."""
    fence = re.compile(r'^```(\w+)(?: title="([^"]+)")?\n(.*?)^```$', re.M | re.S)
    return [(m[1], m[2] or "", m[3]) for m in fence.finditer(page.read_text())]


def recipe_files(page: Path = PAGE) -> dict[str, str]:
    """The page's files by name: each code block titled with a file name."""
    files = {title: code for _, title, code in code_blocks(page) if title}
    assert sorted(files) == sorted(FILES), sorted(files)
    return files


def with_settings(code: str, settings: dict[str, str]) -> str:
    """``code`` with each ``NAME = ...`` line of ``settings`` set to its value; each must be
    there exactly once, so that a page that renames one fails here, not silently."""
    for name, value in settings.items():
        code, found = re.subn(rf"^{name} = [^#\n]*", f"{name} = {value}  ", code, flags=re.M)
        assert found == 1, f"train.py sets {name} {found} times, not once"
    return code


def write_recipe(folder: Path, settings: dict[str, str]) -> None:
    """The page's files in ``folder``, ``train.py``'s ``settings`` changed."""
    for name, code in recipe_files().items():
        (folder / name).write_text(with_settings(code, settings) if name == "train.py" else code)


def run_train(folder: Path, timeout_s: int) -> tuple[subprocess.CompletedProcess[str], str]:
    """``python train.py`` in ``folder`` as a user runs it; the process and its output."""
    env = {k: v for k, v in os.environ.items() if k != "VOLTRL_TOKEN"}
    done = subprocess.run(
        [sys.executable, "train.py"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )
    return done, done.stdout + done.stderr


def test_the_page_says_how_to_try_the_plumbing_as_this_test_does() -> None:
    text = PAGE.read_text()
    for name, value in TRY_THE_PLUMBING.items():
        assert f"`{name} = {value}`" in text, f"the page no longer says {name} = {value}"
    train = recipe_files()["train.py"]
    assert 'MODEL = "smollm2-135m-instruct"' in train  # the real model is the one taught
    for setting in ('"use_lora": True', '"lora_r": 16', '"lr": 2e-4', '"mode": "trajectory"'):
        assert setting in train, setting
    assert "batch_size=16" in train and "SFT_STEPS = 24" in train


def test_the_pages_reward_tests_pass_and_its_offline_teacher_prints_what_it_says(
    tmp_path: Path,
) -> None:
    write_recipe(tmp_path, {})
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_convert_agent.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
    assert re.search(r"\b10 passed\b", tests.stdout), tests.stdout[-3000:]
    (offline,) = [c for lang, _, c in code_blocks() if lang == "python" and "episode_rng(" in c]
    done = subprocess.run(
        [sys.executable, "-c", offline], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    said = re.findall(r"^# (the teacher calls .*)$", offline, flags=re.M)
    assert said and done.stdout.strip() == said[0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_pages_recipe_runs_as_written_on_the_tiny_model(tmp_path: Path) -> None:
    write_recipe(tmp_path, TRY_THE_PLUMBING)
    done, output = run_train(tmp_path, 840)
    assert done.returncode == 0, output[-6000:]
    solved = re.search(r"the teacher solved (\d+)% of its tasks", done.stdout)
    assert solved and 40 <= int(solved[1]) <= 75, output[-6000:]  # it errs on purpose
    assert re.search(r"held-out: \d+% after the warm-up, \d+% after RL", done.stdout), output
    assert (tmp_path / "runs" / "convert-teacher" / "store.sqlite").is_file()
    assert (tmp_path / "runs" / "convert-rl" / "final" / "config.json").is_file()


@pytest.mark.slow
def test_the_shells_teacher_answers_the_pages_client(tmp_path: Path) -> None:
    write_recipe(tmp_path, {})
    (command,) = [
        line.split("#")[0].split()
        for language, _, code in code_blocks()
        if language == "bash"
        for line in code.splitlines()
        if line.startswith("voltrl teacher serve")
    ]
    served = Served(*command[3:], "--port", "0", command=("teacher", "serve"), cwd=tmp_path)
    try:
        (client,) = [
            c for lang, title, c in code_blocks() if lang == "python" and "OpenAI(" in c
        ]  # fmt: skip
        assert "http://127.0.0.1:8001/v1" in client  # the default port, as the page says
        client = client.replace("http://127.0.0.1:8001/v1", served.endpoint)
        done = subprocess.run(
            [sys.executable, "-c", client], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        plumbing = [run_line(line, served.endpoint, tmp_path) for line in plumbing_lines()]
    finally:
        served.stop()
    assert done.returncode == 0, done.stderr
    said = re.findall(r"^# (Function\(.*\))$", client, flags=re.M)
    assert said and done.stdout.strip() == said[0]  # what the page says it prints
    # the plumbing check: a few tasks written, the agent run on them against the teacher
    wrote, dev = plumbing
    assert wrote.returncode == 0 and len((tmp_path / "few.jsonl").read_text().splitlines()) == 8
    assert dev.returncode == 0, dev.stdout[-3000:] + dev.stderr[-3000:]  # none failed
    result = re.search(r"result: reward ([\d.]+) over the dev rollouts \(8 rollouts\)", dev.stdout)
    assert result and 0 < float(result[1]) < 1, dev.stdout[-3000:]  # the teacher errs on purpose


def plumbing_lines() -> list[str]:
    """The shell lines of the page's "try the plumbing first" block."""
    (block,) = [c for lang, _, c in code_blocks() if lang == "bash" and "few.jsonl" in c]
    return block.strip().splitlines()


def run_line(line: str, endpoint: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A page's shell line run as a user would: ``python`` and ``voltrl`` this environment's,
    the teacher's default address replaced with ``endpoint``."""
    import shlex

    words = shlex.split(line.replace("http://127.0.0.1:8001/v1", endpoint))
    head = {"python": [sys.executable], "voltrl": [sys.executable, "-m", "voltrl.cli"]}
    return subprocess.run(
        [*head[words[0]], *words[1:]], cwd=cwd, capture_output=True, text=True, timeout=120
    )
