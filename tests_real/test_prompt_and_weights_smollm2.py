"""APO then LocalRL in one run on the real pretrained model: ``benchmarks/prompt_and_weights.py``
at its smallest (1 round, 1 step) on SmolLM2, every arm end to end, the model being trained
writing APO's rewrites."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1500)
def test_the_four_arms_run_on_smollm2(model_dir: Path, tmp_path: Path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "prompt_and_weights.py"),
         "--arms", "start", "apo", "rl", "apo+rl", "--seeds", "0", "--rounds", "1",
         "--beam-width", "1", "--branch-factor", "1", "--train-batch", "2", "--steps", "1",
         "--tasks-per-step", "2", "--group-size", "2", "--val-size", "4",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=1440,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "prompt_and_weights.json").read_text())
    assert [r["arm"] for r in rows] == ["start", "apo", "rl", "apo+rl"]
    assert all(r["val_rows"] == 4 for r in rows)
    assert "prompt search (APO) on the model before training it" in out.stdout
    assert "| apo+rl |" in out.stdout
