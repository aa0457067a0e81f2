"""A prompt optimisation run's record (``<run dir>/prompt_search.json``): every candidate
template APO tried, with its round, parent, score and fate, written after each round; what
``voltrl show`` and the dashboard show of such a run (:func:`load`, :func:`template_diff`).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Literal

from voltrl.types import Model

FILE = "prompt_search.json"

CandidateStatus = Literal["pending", "kept", "dropped", "rejected", "failed"]
"""``pending``: accepted, not scored yet (a run that stopped mid-round leaves some); ``kept``: in
the beam after the last round done (the starting template is ``kept`` until a better one
pushes it out); ``dropped``: scored, then left out of the beam; ``rejected``: refused before it
ran (a template variable dropped or added, broken syntax, a field other than a plain
``{name}``, a repeat); ``failed``: the optimizer call that should have written it failed."""


class Candidate(Model):
    """One template APO tried (or refused)."""

    round: int
    """0 for the starting template, else the round that wrote it."""
    template: str
    status: CandidateStatus
    version: int | None = None
    """The resources version that holds it (None when it was never published)."""
    parent: int | None = None
    """The version of the template it was rewritten from."""
    score: float | None = None
    """Mean validation reward (a failed rollout counts 0)."""
    train_score: float | None = None
    """Mean reward on the training batch it was critiqued on (beam members only)."""
    critique: str | None = None
    """The optimizer's critique of its parent that it answers."""
    reason: str | None = None
    """Why it was rejected or failed."""
    repaired: str | None = None
    """What APO changed in the optimizer's rewrite before checking it (placeholders it had
    left out, appended), or None."""
    optimizer_rollout: str | None = None
    """The rollout holding the optimizer's calls that wrote it (mode ``optimizer``)."""


class PromptSearch(Model):
    """The whole search: what ``prompt_search.json`` holds."""

    resource: str
    engine: str = "f-string"
    candidates: list[Candidate]
    rounds_done: int = 0
    best_version: int | None = None
    best_score: float | None = None
    stopped: str | None = None
    """Why the search ended (None while it runs)."""
    finished: bool = False
    """Whether it ended on its own (its rounds done, or its patience out), not interrupted or
    failed: a resumed ``LocalRL(prompt_search=...)`` run does not search again then."""

    @property
    def start(self) -> Candidate:
        """The starting template."""
        return self.candidates[0]

    @property
    def best(self) -> Candidate | None:
        """The best scored template so far."""
        return next((c for c in self.candidates if c.version == self.best_version), None)

    def save(self, run_dir: Path) -> Path:
        """Write it to ``run_dir/prompt_search.json`` (atomically)."""
        path = run_dir / FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.model_dump(), indent=2, ensure_ascii=False) + "\n")
        tmp.replace(path)
        return path


def load(run_dir: Path) -> PromptSearch | None:
    """The search recorded in ``run_dir``, or None when the run is not a prompt search."""
    path = run_dir / FILE
    if not path.is_file():
        return None
    return PromptSearch.model_validate_json(path.read_text())


def template_diff(before: str, after: str) -> list[str]:
    """A unified diff of two templates, line by line (empty when they are the same)."""
    return list(
        difflib.unified_diff(
            before.splitlines(), after.splitlines(), "start", "best", lineterm="", n=2
        )
    )
