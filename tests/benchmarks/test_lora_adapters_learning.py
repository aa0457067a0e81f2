"""``benchmarks/lora_adapters_learning.py``: each arm's update settings from a recipe's, and
the table's means with their intervals (its runs are measured, not tested: tens of minutes)."""

from __future__ import annotations

import importlib

import pytest
from helpers import ROOT


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("lora_adapters_learning")


TINY_UPDATE = {"lr": 2e-4, "micro_batch_size": 32, "clip_eps": 0.2}
SMOLLM2_UPDATE = {"use_lora": True, "lr": 2e-4, "micro_batch_size": 8, "clip_eps": 0.2}


def test_a_lora_arm_of_a_full_fine_tuning_recipe_gets_ten_times_its_rate(bench) -> None:
    for arm in ("two adapters", "one shared adapter", "checker frozen"):
        update = bench.arm_update(TINY_UPDATE, arm)
        assert update == {
            "micro_batch_size": 32,
            "clip_eps": 0.2,
            "use_lora": True,
            "lora_r": 16,
            "lora_alpha": 32,
            "lr": pytest.approx(2e-3),
        }
    assert bench.arm_update(TINY_UPDATE, "full fine-tuning") == TINY_UPDATE


def test_a_lora_recipe_keeps_its_rate_and_rank_and_full_fine_tuning_gets_a_tenth(bench) -> None:
    update = bench.arm_update({**SMOLLM2_UPDATE, "lora_r": 8}, "two adapters")
    assert update["lr"] == pytest.approx(2e-4) and update["lora_r"] == 8
    full = bench.arm_update({**SMOLLM2_UPDATE, "lora_r": 8}, "full fine-tuning")
    assert full == {"lr": pytest.approx(2e-5), "micro_batch_size": 8, "clip_eps": 0.2}


def test_the_checker_frozen_arm_serves_only_the_writer_from_an_adapter(bench) -> None:
    assert bench.ARMS["checker frozen"]["lora_adapters"] == {"writer": "write|rewrite"}
    assert set(bench.ARMS_OF["smollm2-135m-instruct"]) == {
        "one shared adapter",
        "two adapters",
        "checker frozen",
    }


def test_the_table_gives_each_arm_a_mean_with_its_interval_over_seeds(bench) -> None:
    rows = [
        {
            "arm": "two adapters",
            "seed": seed,
            "after_sft": 0.5,
            "after_rl": after,
            "minutes": 20.0,
            "peak_gib": peak,
            "tokens": {"writer": 1000.0, "checker": 200.0},
        }
        for seed, (after, peak) in enumerate([(0.6, 3.0), (0.7, 3.5), (0.8, 3.2)])
    ]
    lines = bench.table(rows, ["two adapters"])
    assert lines[2] == (
        "| two adapters | 0 | 50.0% | 60.0% | +10.0 pts | 20.0 | 3.0 GiB "
        "| writer 1,000, checker 200 |"
    )
    # mean 70%, t(2) 4.303 x sd 0.1 / sqrt(3) = 24.8 points either side
    assert lines[-1] == (
        "| **two adapters** | mean of 3 | 50.0% | 70.0% ± 24.8 | **+20.0 ± 24.8 pts** "
        "| 20.0 | 3.5 GiB | |"
    )
