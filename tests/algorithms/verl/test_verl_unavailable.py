"""Without verl (this environment has none), ``import voltrl`` works and ``vl.VERL`` fails with
a clear message naming the extra and the supported versions. The integration itself is tested
against the real verl package in tests_verl/ (``make test-verl``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

import voltrl as vl
from voltrl.algorithms.verl.version import SUPPORTED_VERL, VerlUnavailableError


@pytest.mark.skipif(
    importlib.util.find_spec("verl") is not None,
    reason="checks the error when verl is missing; tests_verl/ covers the installed case",
)
def test_vl_verl_names_the_extra_and_the_versions():
    with pytest.raises(VerlUnavailableError) as info:
        vl.VERL({"actor_rollout_ref": {"model": {"path": "m"}}})
    assert "voltrl[verl]" in str(info.value) and SUPPORTED_VERL in str(info.value)
    assert isinstance(info.value, ImportError) and isinstance(info.value, vl.VoltRLError)


@pytest.mark.slow
def test_import_voltrl_does_not_import_verl():
    code = "import sys, voltrl; assert voltrl.VERL; print('verl' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
