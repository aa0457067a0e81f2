"""The documentation site builds, strict, and the README stays a front page.

``mkdocs.yml`` turns every MkDocs warning into an error (``strict: true`` and its
``validation`` section): a link to a page or an anchor that does not exist, a page left out of
the nav, a nav entry with no page. The README is not part of the site, so its own links to
``docs/`` are checked here, and so is its length: what a project is, the two commands, install,
a quick start and links, with the rest in ``docs/``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import ROOT

DOCS = ROOT / "docs"
README_MAX_LINES = 250
LINK = re.compile(r"\]\(([^)\s]+)\)")


def nav_pages(nav: Any) -> list[str]:
    """Every page path a MkDocs ``nav`` lists, however deep its sections go."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for entry in nav for page in nav_pages(entry)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return []


def config() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


@pytest.mark.timeout(120)  # mkdocs comes with the dev extra: make test installs it
def test_the_site_builds_strict_with_no_warning(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "mkdocs", "build", "--strict"]
    command += ["--site-dir", str(tmp_path / "site"), "--config-file", str(ROOT / "mkdocs.yml")]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # not Material's notice about MkDocs 2
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=110, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{output[-6000:]}"
    assert "WARNING" not in output, output[-6000:]
    for page in ("index.html", "install.html", "adapters/autogen.html"):  # opens from disk too
        assert (tmp_path / "site" / page).is_file(), f"the build left no {page}"
    home = (tmp_path / "site" / "index.html").read_text()
    assert 'href="install.html"' in home  # links that work without a server


def test_the_config_is_strict_and_validates_links_and_anchors() -> None:
    settings = config()
    assert settings["strict"] is True and settings["docs_dir"] == "docs"
    assert settings["theme"]["name"] == "material"
    links = settings["validation"]["links"]
    assert links["not_found"] == links["anchors"] == "warn", links  # strict: warnings fail
    assert settings["validation"]["nav"]["omitted_files"] == "warn"


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    listed = nav_pages(config()["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    missing = sorted(set(pages) - set(listed))
    assert not missing, f"docs pages missing from mkdocs.yml's nav: {missing}"
    gone = sorted(set(listed) - set(pages))
    assert not gone, f"mkdocs.yml's nav lists pages that do not exist: {gone}"
    twice = sorted({p for p in listed if listed.count(p) > 1})
    assert not twice, f"pages listed twice in the nav: {twice}"


def test_the_readme_is_a_front_page_of_at_most_250_lines() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; keep it to {README_MAX_LINES} (what VoltRL is, the "
        "two commands, install, a quick start, links) and move the rest into docs/"
    )
    first_screens = "\n".join(lines[:100])
    for needed in ("make demo", "make test", "## Install", "pip install", "## Quick start"):
        assert needed in first_screens, f"README's first 100 lines lack {needed!r}"


def test_the_readmes_relative_links_reach_files_that_exist() -> None:
    text = (ROOT / "README.md").read_text()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (ROOT / path).exists():
            broken.append(target)
    assert not broken, f"README.md links to files that do not exist: {broken}"
    assert "docs/" in text, "README.md links to no docs page"


DOTTED = re.compile(
    r"`(voltrl\.(?:algorithms|models|serving|observability|store|runtime|cli|gateway)"
    r"(?:\.[A-Za-z_][A-Za-z0-9_]*)+)"
)
"""A dotted path into a package of voltrl at the start of a code span
(``voltrl.serving.engine.Engine``); other ``voltrl.`` names in the docs are keys (verl's
``voltrl.ray_address``, OTLP's ``voltrl.reward``), not Python."""


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module of voltrl, or an attribute of one."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            found: Any = importlib.import_module(name)
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                found = getattr(found, attr)
        except AttributeError:
            return False
        return True
    return False


def test_every_voltrl_path_the_docs_name_exists() -> None:
    """A code span naming ``voltrl.x.y`` (a module, or a name in one) names something that
    imports, so a moved module or a renamed function cannot leave the docs behind; the old
    paths of moved modules appear only where the docs say they moved."""
    from voltrl._moved import MOVED

    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    old_paths = re.compile(r"`(" + "|".join(re.escape(m) for m in MOVED) + r")\b")
    wrong = []
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            where = f"{page.relative_to(ROOT)}:{number}"
            said = ("moved", "old path", "deprecat", "|")  # "|": a table of old -> new paths
            if not any(word in line.lower() for word in said):
                wrong += [f"{where}: {m} (an old path)" for m in old_paths.findall(line)]
            for dotted in DOTTED.findall(line):
                old = any(dotted == m or dotted.startswith(f"{m}.") for m in MOVED)
                if not old and not resolves(dotted):
                    wrong.append(f"{where}: {dotted}")
    assert wrong == []


def test_the_cli_pages_table_lists_every_voltrl_command() -> None:
    """Each command ``voltrl --help`` lists (a group's, like ``model serve``, one by one) has a
    row in the table at the top of ``docs/cli.md``, the map of the commands."""
    import argparse

    from voltrl.cli.main import build_parser

    def commands(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return [prefix]
        return [c for name, p in subs[0].choices.items() for c in commands(p, f"{prefix} {name}")]

    table = [line for line in (DOCS / "cli.md").read_text().splitlines() if line.startswith("| `")]
    missing = [c for c in commands(build_parser(), "voltrl") if not any(
        row.startswith(f"| `{c}`") or row.startswith(f"| `{c} ") for row in table
    )]  # fmt: skip
    assert missing == []
