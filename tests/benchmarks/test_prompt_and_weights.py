"""``benchmarks/prompt_and_weights.py``: its table (intervals over seeds, the verdict on one
phase against both), and the four arms end to end on the tiny model (APO's optimizer the
model being trained, as by default)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from helpers import ROOT


def bench():
    spec = importlib.util.spec_from_file_location(
        "prompt_and_weights", ROOT / "benchmarks" / "prompt_and_weights.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def rows(scores: dict[str, list[float]]) -> list[dict]:
    return [
        {"arm": arm, "seed": seed, "score": s}
        for arm, each in scores.items()
        for seed, s in enumerate(each)
    ]


def test_the_table_gives_intervals_over_seeds_and_says_when_one_phase_is_as_good() -> None:
    b = bench()
    mean, half = b.interval([0.5, 0.6, 0.7])
    assert mean == pytest.approx(0.6) and half == pytest.approx(4.303 * 0.1 / 3**0.5)
    same = {"start": [0, 0, 0], "apo": [0.5, 0.6, 0.7], "rl": [0.2, 0.3, 0.2]}
    lines = b.table(rows({**same, "apo+rl": [0.6, 0.6, 0.7]}), list(b.ARMS))
    assert "| apo | 0.500, 0.600, 0.700 | 0.600 | 0.352 to 0.848 | +0.600 |" in lines
    assert (
        lines[-1]
        == "\napo+rl 0.633, apo alone 0.600: apo alone is as good as both, within the intervals."
    )
    lines = b.table(rows({**same, "apo+rl": [0.9, 0.9, 0.91]}), list(b.ARMS))
    assert lines[-1].endswith("apo+rl beats apo alone, the intervals apart.")
    lines = b.table(rows({"apo": [0.5], "apo+rl": [0.6]}), ["apo", "apo+rl"])
    assert "n/a (1 seed)" in lines[2] and lines[-1].endswith("one seed: no verdict.")


def test_arms_not_run_are_read_from_the_first_validations_of_those_that_contain_them() -> None:
    b = bench()
    ran = [
        {"arm": "rl", "seed": 0, "score": 0.3, "first_validation": 0.0},
        {"arm": "apo+rl", "seed": 0, "score": 0.7, "first_validation": 0.5},
    ]
    extra = b.derived(ran, ["rl", "apo+rl"])
    assert [(r["arm"], r["score"], r["from"]) for r in extra] == [
        ("start", 0.0, "rl"),
        ("apo", 0.5, "apo+rl"),
    ]
    assert b.derived(ran, ["start", "apo", "rl", "apo+rl"]) == []  # run themselves


@pytest.mark.slow
def test_the_four_arms_run_on_the_tiny_model(tmp_path: Path, capsys) -> None:
    b = bench()
    argv = ["--model", "tiny", "--seeds", "0", "--rounds", "1", "--beam-width", "1"]
    argv += ["--branch-factor", "1", "--train-batch", "2", "--steps", "1"]
    argv += ["--tasks-per-step", "2", "--group-size", "2", "--val-size", "2"]
    assert b.main([*argv, "--out", str(tmp_path)]) == 0
    found = json.loads((tmp_path / "prompt_and_weights.json").read_text())
    assert [r["arm"] for r in found] == ["start", "apo", "rl", "apo+rl"]
    assert all(r["val_rows"] == 2 and 0.0 <= r["score"] <= 1.0 for r in found)
    for r in found[1::2]:  # the search's summary, for the arms that searched
        assert len(r["search_best_per_round"]) == 2 and r["search_rewrites"] == 1
        assert r["search_minutes"] > 0
    assert not list((tmp_path / "runs").iterdir())  # deleted without --keep-runs
    out = capsys.readouterr().out
    assert "| arm | held-out score per seed |" in out and "one seed: no verdict." in out
