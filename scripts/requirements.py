"""Print the requirements of voltrl with some extras, one per line, from pyproject.toml (its
own extras, such as ``voltrl[local]`` inside ``all``, expanded): what ``pip install -e
".[EXTRAS]"`` would install besides voltrl itself.

    python3 scripts/requirements.py dev,all > requirements.txt

``make test`` installs its three environments side by side; the VERL and AgentScope ones
install these, then voltrl itself with ``--no-deps``, taking turns with the others for that
step, since every editable install rewrites ``voltrl.egg-info`` in the source tree.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(extras: list[str]) -> list[str]:
    """voltrl's dependencies and those of ``extras``, in order, each once."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    optional = project["optional-dependencies"]
    out, seen, todo = list(project["dependencies"]), set(), list(extras)
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"no extra {extra!r} in {PYPROJECT}; it has {', '.join(optional)}")
        seen.add(extra)
        for requirement in optional[extra]:
            own = re.fullmatch(rf"{project['name']}\[(.+)\]", requirement.strip())
            if own:
                todo += [e.strip() for e in own.group(1).split(",")]
            elif requirement not in out:
                out.append(requirement)
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1].split(",") if len(sys.argv) > 1 else [])))
