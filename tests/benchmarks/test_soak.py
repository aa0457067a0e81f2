"""The soak benchmark's short version: 12 LocalRL steps on the tiny model with a fault every 2
(a runner worker SIGKILLed, the store server restarted, the trainer SIGTERMed and resumed, a
full disk on a checkpoint) and, throughout, an agent hanging past its timeout, a client giving
up mid-call and a blocking tracker. Real processes: ``voltrl serve``, the trainer, its
runners. ``benchmarks/soak.py`` without arguments is the 200-step run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_short_soak_with_every_fault_loses_no_rollout_and_trains_none_twice(
    tmp_path: Path,
) -> None:
    out = subprocess.run(
        [
            *(sys.executable, str(ROOT / "benchmarks" / "soak.py")),
            *("--steps", "12", "--fault-every", "2", "--dir", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=840,
    )
    log = (tmp_path / "trainer.log").read_text() if (tmp_path / "trainer.log").exists() else ""
    assert out.returncode == 0, out.stdout + out.stderr + log[-3000:]
    text = out.stdout
    for kind in ("kill worker", "restart store", "sigterm trainer", "full disk"):
        assert f": {kind}" in text, text  # every fault was injected
    assert "rollouts lost: 0\n" in text and "rollouts trained twice: 0 " in text
    assert "steps completed: 12\n" in text and "soak: OK" in text
    assert re.search(r"call cut off: client_disconnected': [1-9]", text), text
    kept = sorted(p.name for p in (tmp_path / "runs" / "soak" / "checkpoints").iterdir())
    assert len(kept) == 3 and kept[-1] == "step_00000012"  # keep_checkpoints bounds the disk
