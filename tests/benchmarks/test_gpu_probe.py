"""benchmarks/gpu_probe.py runs on a CPU with small shapes (its code is the one a GPU runs)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_gpu_probe_prints_its_three_parts_on_a_cpu() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_probe.py"), "--small", "--demo-steps", "1"],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "gpu_probe: CPU;" in text
    for concurrency in (1, 16, 64):
        assert f"\n| {concurrency} | " in text
    for dtype in ("float32", "bfloat16"):
        for checkpointing in ("False", "True"):
            assert f"| {dtype} | {checkpointing} | " in text
    assert "| step | rollouts | rollout s | update s |\n|---|---|---|---|\n| 1 | 4 | " in text
