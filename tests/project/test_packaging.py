"""The wheel: built without setuptools warnings, with the local engine's tokenizer assets and
the dashboard's pages and scripts."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from helpers import ROOT


def test_wheel_builds_without_warnings_and_ships_the_tiny_tokenizer(tmp_path: Path) -> None:
    source = tmp_path / "src"  # a copy, so the build leaves no build/ in the checkout
    skip = shutil.ignore_patterns("__pycache__")
    for tree in ("core", "adapters"):
        shutil.copytree(ROOT / tree, source / tree, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    out = subprocess.run(
        [*pip_wheel, "-w", str(tmp_path / "wheel"), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "warning" not in log.lower(), log
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    assets = "voltrl/models/assets/tiny-tokenizer/"
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {assets + "tokenizer.json", assets + "tokenizer_config.json"} <= names
    # the dashboard works offline: its pages and scripts ship with it
    ui = "voltrl/observability/dashboard/"
    assert {ui + "templates/rollout.html", ui + "static/dashboard.js"} <= names
    assert {ui + "static/vendor/htmx-2.0.11.min.js", ui + "static/vendor/LICENSES.txt"} <= names
    # every module ships: a new package left out of pyproject.toml's list would not
    modules = {f"voltrl/{p.relative_to(ROOT / 'core')}" for p in (ROOT / "core").rglob("*.py")}
    modules |= {
        f"voltrl/adapters/{p.relative_to(ROOT / 'adapters')}"
        for p in (ROOT / "adapters").rglob("*.py")
    }
    assert modules - names == set()
