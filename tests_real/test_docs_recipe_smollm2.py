"""The real-model recipe of ``docs/own_agent_real_model.md`` as written, on SmolLM2: the page's
files copied out and ``python train.py`` run with one RL step (``RL_STEPS = 1``), the
teacher recording and the warm-up in full. The warm-up is what makes RL possible (zero-shot,
the model never calls the tool), so it must leave a model that solves some held-out questions.
About 10 minutes on 2 CPU cores."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "project"))

from test_docs_recipe import PAGE, code_blocks, run_train, write_recipe  # noqa: E402  (as the main suite does)


@pytest.mark.timeout(3600)
def test_the_pages_recipe_warms_smollm2_up_and_takes_an_rl_step(
    model_dir: Path, tmp_path: Path
) -> None:
    write_recipe(tmp_path, {"RL_STEPS": "1"})
    done, output = run_train(tmp_path, 3500)
    assert done.returncode == 0, output[-8000:]
    solved = re.search(r"the teacher solved (\d+)% of its tasks", done.stdout)
    assert solved and 40 <= int(solved[1]) <= 75, output[-8000:]  # it errs on purpose
    found = re.search(r"held-out: (\d+)% after the warm-up, (\d+)% after RL", done.stdout)
    assert found, output[-8000:]
    print(done.stdout)  # the figures, with pytest -s or -rP
    assert int(found[1]) > 0, "the warm-up taught SmolLM2 nothing it can use on held-out questions"
    assert (tmp_path / "runs" / "convert-rl" / "final" / "adapter").is_dir() or (
        tmp_path / "runs" / "convert-rl" / "final" / "config.json"
    ).is_file()


def test_the_pages_token_count_of_a_tool_call_is_what_it_prints(model_dir: Path) -> None:
    """The page's snippet that counts a reply's tokens, run as written, prints the number its
    comment and the settings' text give (46 for the ``convert`` call)."""
    (snippet,) = [c for lang, _, c in code_blocks() if lang == "python" and "load_tokenizer(" in c]
    claimed = re.search(r"# (\d+): the reply's tokens", snippet)
    assert claimed, "the snippet no longer says what it prints"
    assert f"call is {claimed[1]} SmolLM2 tokens" in " ".join(PAGE.read_text().split())
    done = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split()[-1] == claimed[1]
