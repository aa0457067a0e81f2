"""Without the ``[local]`` extra, ``vl.LocalRL`` says which extra to install (checked in a
process where torch cannot be imported)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["torch"] = None  # as if torch were not installed
import voltrl as vl
try:
    vl.LocalRL("tiny")
except vl.VoltRLError as exc:
    print(exc)
"""


def test_local_rl_without_torch_names_the_extra() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "LocalRL needs torch, which is not installed: pip install 'voltrl[local]'"
    )
