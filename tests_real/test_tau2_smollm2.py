"""The tau2 airline sample trains the real pretrained model on tau2's own train split: the
packaged model by name, tau2's 5.3k-token first prompt inside its 8,192-token context, one
LocalRL step with a row per conversation, and the run's final model saved."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)
def test_run_py_trains_smollm2_on_tau2s_train_split(model_dir: Path, tmp_path: Path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "samples" / "tau2_airline" / "run.py"), "train",
         "--model", "smollm2-135m-instruct", "--user", "scripted", "--steps", "1",
         "--tasks-per-step", "1", "--group-size", "2", "--n-val", "1", "--max-tokens", "64",
         "--run-dir", str(tmp_path), "--name", "smol"],
        capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "warning: the scripted customer plays tau2's tasks" in out.stderr
    assert "step 1: 2 assistant rows (0 merge failures)" in out.stdout
    assert "context_overflow" not in out.stdout  # tau2's first prompt fits SmolLM2
    assert (tmp_path / "smol" / "final" / "config.json").is_file()
