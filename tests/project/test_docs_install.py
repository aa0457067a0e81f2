"""Every install line the docs print works as printed (issue 32). voltrl is on no package index,
so each line installs the clone (``pip install -e ".[extra]"``, from its root) or the wheel that
``make dist`` builds (``pip install "dist/voltrl-<version>-py3-none-any.whl[extra]"``), names
extras that exist and constraint files that exist (the one pinning the frameworks it installs),
and resolves: pip's dry run of the line's voltrl part, run in a copy of the clone, succeeds with
the extras it names. The dry runs use the package index (CI reaches it); torch stays at the
version ``[local]`` pins, so pip never looks at another build of it."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import ROOT
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]
WHEEL = f"dist/voltrl-{PROJECT['version']}-py3-none-any.whl"
TORCH = next(r for r in EXTRAS["local"] if Requirement(r).name == "torch")
"""``[local]``'s torch pin (``torch==2.13.0``): every dry run is held to it."""

CLONE_TARGET = re.compile(r"\.(?:\[(?P<extras>[^\]]*)\])?")
WHEEL_TARGET = re.compile(r"(?P<path>[^\[]*voltrl-[^/\[]*\.whl)(?:\[(?P<extras>[^\]]*)\])?")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`([^`]+)`")
OPTIONS_WITH_VALUE = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-r"}


def doc_files() -> list[Path]:
    """The Markdown a user reads: the README, the samples' READMEs and docs/."""
    return [
        ROOT / "README.md",
        *sorted(ROOT.glob("samples/*/README.md")),
        *sorted((ROOT / "docs").rglob("*.md")),
    ]


def doc_commands(text: str) -> list[tuple[int, str]]:
    """Each command shown in ``text`` with its line number: every line of a fenced block
    (``\\``-continued lines joined) and every inline code span (which may wrap)."""
    commands: list[tuple[int, str]] = []
    prose: list[str] = []
    fenced, pending, start = False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            prose.append("")
            continue
        if not fenced:
            prose.append(line)
            continue
        prose.append("")
        start = start if pending else number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        commands.append((start, pending + line))
        pending = ""
    joined = "\n".join(prose)
    for match in CODE_SPAN.finditer(joined):
        number = joined.count("\n", 0, match.start()) + 1
        commands.append((number, match.group(1).replace("\n", " ")))
    return commands


@dataclass(frozen=True)
class InstallLine:
    """One documented ``pip install`` of voltrl, as printed and as parsed."""

    where: str
    command: str
    target: str
    """``.`` (the clone), the wheel's path, or a requirement by name (``voltrl[...]``)."""
    editable: bool
    extras: tuple[str, ...]
    constraints: tuple[str, ...]

    def pip_args(self) -> list[str]:
        """The line's voltrl part as pip arguments (third-party packages it adds left out)."""
        target = f"{self.target}[{','.join(self.extras)}]" if self.extras else self.target
        constraints = [arg for c in self.constraints for arg in ("-c", c)]
        return [*(["-e"] if self.editable else []), target, *constraints]


def parse(where: str, command: str) -> InstallLine | None:
    """``command``'s install of voltrl, or None when it installs no voltrl. Only the text from
    the first ``pip install`` on is read: what comes before it (a prompt, an error message
    quoting the line, ``python -m``) is no part of the install."""
    text = command[command.index("pip install") :] if "pip install" in command else command
    try:
        words = shlex.split(text, comments=True)
    except ValueError as exc:
        raise ValueError(f"{where}: `{command}` cannot be read as a shell line: {exc}") from None
    if "pip" not in words or "install" not in words[words.index("pip") :]:
        return None
    args = words[words.index("install", words.index("pip")) + 1 :]
    constraints: list[str] = []
    found: list[tuple[str, bool, str | None]] = []
    editable = False
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if arg in {"-c", "--constraint"}:
            constraints.append(args[index])
            index += 1
        elif arg in {"-e", "--editable"}:
            editable = True
        elif arg in OPTIONS_WITH_VALUE:
            index += 1
        elif not arg.startswith("-"):
            if clone := CLONE_TARGET.fullmatch(arg):
                found.append((".", editable, clone.group("extras")))
            elif wheel := WHEEL_TARGET.fullmatch(arg):
                found.append((wheel.group("path"), editable, wheel.group("extras")))
            elif by_name(arg) == "voltrl":
                found.append(("voltrl", editable, ",".join(sorted(Requirement(arg).extras))))
            editable = False
    if not found:
        return None
    assert len(found) == 1, f"{where}: `{command}` installs voltrl twice"
    target, is_editable, extras = found[0]
    names = tuple(e.strip() for e in (extras or "").split(",") if e.strip())
    return InstallLine(where, command, target, is_editable, names, tuple(constraints))


def by_name(arg: str) -> str | None:
    """The project ``arg`` names as a requirement, or None when it is no requirement."""
    try:
        return canonicalize_name(Requirement(arg).name)
    except InvalidRequirement:
        return None


def install_lines() -> list[InstallLine]:
    """Every documented install of voltrl, in every doc file."""
    lines = []
    for path in doc_files():
        for number, command in doc_commands(path.read_text()):
            where = f"{path.relative_to(ROOT)}:{number}"
            if "pip install" in command and (line := parse(where, command)):
                lines.append(line)
    return lines


LINES = install_lines()
CLONE_LINES = [line for line in LINES if line.target == "."]
WHEEL_LINES = [line for line in LINES if line.target.endswith(".whl")]


def with_included(extras: tuple[str, ...]) -> set[str]:
    """``extras`` and those they include (``[all]`` includes ``[local]``, ...)."""
    found = set(extras)
    for extra in extras:
        for text in EXTRAS[extra]:
            requirement = Requirement(text)
            if canonicalize_name(requirement.name) == "voltrl":
                found |= with_included(tuple(sorted(requirement.extras)))
    return found


def requirement_names(extras: tuple[str, ...]) -> set[str]:
    """The projects ``extras`` require, voltrl's own extras (``[all]``) expanded."""
    names = {
        canonicalize_name(Requirement(t).name) for e in with_included(extras) for t in EXTRAS[e]
    }
    return names - {"voltrl"}


def pinned(constraint_file: Path) -> set[str]:
    """The projects a constraint file pins."""
    lines = (line.split("#")[0].strip() for line in constraint_file.read_text().splitlines())
    return {canonicalize_name(Requirement(line).name) for line in lines if line}


PINNED = {f"constraints/{p.name}": pinned(p) for p in sorted(ROOT.glob("constraints/*.txt"))}


def test_the_docs_show_both_ways_to_install() -> None:
    readme = [line for line in LINES if line.where.startswith("README.md")]
    assert any(line.target == "." and line.editable for line in readme), readme
    assert any(line.target == WHEEL for line in readme), readme
    documented = {p.relative_to(ROOT).as_posix() for p in doc_files()}
    for sample in ROOT.glob("samples/*/run.py"):
        readme_path = f"samples/{sample.parent.name}/README.md"
        assert readme_path in documented, f"{sample.parent.name} has no README"
        trains = {"local", "demo", "all"}  # every sample's run.py trains with LocalRL
        assert any(
            line.where.startswith(readme_path) and trains & set(line.extras) for line in LINES
        ), f"{readme_path} does not say how to install what its run.py needs"


@pytest.mark.parametrize("line", LINES, ids=lambda line: line.where)
def test_each_install_line_works_from_a_clone(line: InstallLine) -> None:
    assert line.target != "voltrl", (
        f"{line.where}: `{line.command}` needs voltrl on a package index, and it is on none: "
        'install the clone (`pip install -e ".[extra]"`) or the wheel `make dist` builds'
    )
    if line.target != ".":
        assert line.target == WHEEL, f"{line.where}: `{line.command}`: the wheel is {WHEEL}"
    unknown = [e for e in line.extras if e not in EXTRAS]
    assert not unknown, f"{line.where}: `{line.command}`: no extra {unknown} in pyproject.toml"
    for constraint in line.constraints:
        assert (ROOT / constraint).is_file(), f"{line.where}: `{line.command}`: no {constraint}"
    # a framework that one constraint file pins (not a library that all of them pin, such as
    # openai) is installed with that file: those are the versions its adapter is tested with
    needed = {
        file
        for name in requirement_names(line.extras)
        if len(files := [f for f, names in PINNED.items() if name in names]) == 1
        for file in files
    }
    assert needed <= set(line.constraints), (
        f"{line.where}: `{line.command}` needs `-c {' -c '.join(sorted(needed))}`, the versions "
        "its frameworks are tested with"
    )


def resolve(line: InstallLine, cwd: Path, tmp: Path) -> None:
    """Pip's dry run of ``line``'s voltrl part in ``cwd`` resolves the extras it names (its
    report and the torch pin go to ``tmp``)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "torch.txt").write_text(TORCH + "\n")
    report = tmp / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-input"]
    command += ["--report", str(report), "-c", str(tmp / "torch.txt"), *line.pip_args()]
    run(command, cwd, f"{line.where}: `{line.command}` does not resolve")
    installs = json.loads(report.read_text())["install"]
    voltrl = [i for i in installs if i["metadata"]["name"] == "voltrl"]
    assert voltrl, f"{line.where}: the dry run installs no voltrl: {installs}"
    assert set(line.extras) <= set(voltrl[0].get("requested_extras") or []), voltrl[0]
    torch = [i["metadata"]["version"] for i in installs if i["metadata"]["name"] == "torch"]
    assert all(v.split("+")[0] == TORCH.split("==")[1] for v in torch), torch


def run(command: list[str], cwd: Path, failure: str) -> None:
    """Run ``command`` in ``cwd``; if it fails, fail the test with ``failure`` and the end of
    its output, saying so when the package index looks unreachable (these checks need it)."""
    unreachable = " (is the package index reachable? these checks need it)"
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{failure}: no answer in 150 s{unreachable}")
    if done.returncode != 0:
        output = "\n".join(  # pip's note on each local index without the project goes
            text
            for text in (done.stdout + done.stderr).splitlines()
            if "is ignored: it is neither" not in text
        )
        signs = ("NameResolutionError", "Failed to establish", "timed out", "(from versions: none)")
        hint = unreachable if any(sign in output for sign in signs) else ""
        pytest.fail(f"{failure}{hint}:\n{output[-3000:]}")


def copy_of_clone(dest: Path) -> Path:
    """What a clone needs to be installed from, copied to ``dest`` (pip writes its metadata
    into the source tree, so each resolution gets a copy of its own)."""
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for tree in ("core", "adapters", "constraints"):
        shutil.copytree(ROOT / tree, dest / tree, ignore=skip)
    for name in ("pyproject.toml", "README.md", "Makefile"):
        shutil.copy(ROOT / name, dest / name)
    return dest


def merged(lines: list[InstallLine]) -> list[InstallLine]:
    """The fewest dry runs that cover ``lines``: one install per target and set of constraint
    files, with every extra the docs install that way, and none that another one implies.
    Where an install resolves, so does one with fewer extras and fewer constraints."""
    groups: dict[tuple[str, bool, tuple[str, ...]], list[InstallLine]] = {}
    for line in lines:
        groups.setdefault((line.target, line.editable, line.constraints), []).append(line)
    installs = [
        InstallLine(
            where=", ".join(line.where for line in group),
            command="pip install " + shlex.join(group[0].pip_args()),
            target=target,
            editable=editable,
            extras=tuple(sorted({e for line in group for e in line.extras})),
            constraints=constraints,
        )
        for (target, editable, constraints), group in groups.items()
    ]
    return [line for line in installs if not any(implies(o, line) for o in installs if o != line)]


def implies(wider: InstallLine, line: InstallLine) -> bool:
    """Whether ``wider`` resolving means ``line`` does: the same target, and ``line``'s extras
    and constraint files among its own."""
    return (
        (wider.target, wider.editable) == (line.target, line.editable)
        and set(line.constraints) <= set(wider.constraints)
        and with_included(line.extras) <= with_included(wider.extras)
    )


def merged_id(line: InstallLine) -> str:
    """A test id: the constraint files (or none)."""
    return "+".join(c.removeprefix("constraints/") for c in line.constraints) or "unconstrained"


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("line", merged(CLONE_LINES), ids=merged_id)
def test_the_clone_installs_resolve(line: InstallLine, tmp_path: Path) -> None:
    resolve(line, copy_of_clone(tmp_path / "clone"), tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_make_dist_builds_the_wheel_the_docs_install(tmp_path: Path) -> None:
    """``make dist`` on a fresh copy of the clone (its own .venv, a pinned ``build``) leaves the
    wheel the docs name, with the package data and every extra they use; each documented
    wheel line resolves against it."""
    clone = copy_of_clone(tmp_path / "clone")
    run(["make", "dist", f"PYTHON={sys.executable}"], clone, "make dist failed on a fresh clone")
    wheel = clone / WHEEL
    assert sorted(p.name for p in (clone / "dist").iterdir()) == sorted(
        [wheel.name, f"voltrl-{PROJECT['version']}.tar.gz"]
    )
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(f"voltrl-{PROJECT['version']}.dist-info/METADATA").decode()
    provided = {
        line.split(":", 1)[1].strip()
        for line in metadata.splitlines()
        if line.startswith("Provides-Extra:")
    }
    assert {e for line in LINES for e in line.extras} <= provided
    data = {  # what is not Python in the package: tokenizer, pages, scripts
        f"voltrl/{p.relative_to(ROOT / 'core').as_posix()}"
        for p in (ROOT / "core").rglob("*")
        if p.is_file() and p.suffix not in {".py", ".pyc"}
    }
    assert data - names == set(), "package data left out of the wheel (pyproject.toml)"
    for line in merged(WHEEL_LINES):
        resolve(line, clone, tmp_path / merged_id(line))
