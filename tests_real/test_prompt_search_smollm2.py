"""The prompt-search sample with the real pretrained model as both the classifier's model and
APO's optimizer: ``voltrl model serve`` of the packaged model, a round of critique and rewrite,
every candidate accounted for (scored, or refused with a reason)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)
def test_run_py_searches_with_smollm2_as_agent_and_optimizer(model_dir: Path, tmp_path: Path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "samples" / "prompt_search" / "run.py"), "--rounds", "1",
         "--beam-width", "1", "--branch-factor", "2", "--train-batch", "4",
         "--run-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    search = json.loads((tmp_path / "prompt-search" / "prompt_search.json").read_text())
    start, *written = search["candidates"]
    assert start["score"] is not None and len(written) == 2
    for candidate in written:
        scored = candidate["status"] in ("kept", "dropped") and candidate["score"] is not None
        refused = candidate["status"] == "rejected" and candidate["reason"]
        assert scored or refused, candidate
        assert candidate["critique"]  # the model wrote one
    assert "round 1:" in out.stdout
