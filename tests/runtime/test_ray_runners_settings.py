"""``RayRunners`` settings, checked before anything starts: without Ray installed the trainer
refuses them naming the extra; bad settings are one line; ``voltrl train``'s
``trainer.runners`` section. The runners on a Ray cluster are ``tests_ray/``'s (in
``.venv-verl``, which has Ray; this environment has not)."""

from __future__ import annotations

import sys
import types

import pytest

import voltrl as vl
from voltrl.cli import build_from_config
from voltrl.errors import VoltRLError


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError


@pytest.fixture
def importable_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty module named ray: what ``RayRunners.check`` imports, for the settings tests
    (nothing here starts Ray)."""
    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))


def test_ray_runners_without_ray_fail_when_the_trainer_is_built_naming_the_extra(no_ray):
    with pytest.raises(VoltRLError, match=r"^Ray runners need Ray: pip install 'voltrl\[ray\]'$"):
        vl.Trainer(runners=vl.RayRunners(n=2))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"n": 0}, "n must be >= 1"),
        ({"strategy": "PACK"}, "strategy 'PACK': one of"),
        ({"num_cpus": -1}, "num_cpus must be >= 0"),
        ({"max_restarts": -2}, "max_restarts must be >= -1"),
        ({"n": "four"}, "n is a number of runners or a function"),
    ],
)
def test_bad_ray_runner_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ValueError, match=message):
        vl.RayRunners(**settings)


def test_ray_runners_leave_n_runners_and_inline_alone(importable_ray):
    for other in ({"inline": True}, {"n_runners": 4}, {"n_runners": 0}):
        with pytest.raises(ValueError, match="leave n_runners and inline alone"):
            vl.Trainer(runners=vl.RayRunners(n=2), **other)
    with pytest.raises(TypeError, match="runners: a RayRunners"):
        vl.Trainer(runners=4)


def config(runners, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"x": 1}\n')
    return {
        "agent": "tests_ray_agents_unused:agent",
        "data": {"train": str(data)},
        "trainer": {"runners": runners},
    }


@pytest.mark.parametrize(
    ("runners", "message"),
    [
        (4, r"trainer.runners: ray, or \{ray: \{n: 4, address: auto, ...\}\}"),
        ({"dask": {}}, r"trainer.runners: ray, or"),
        ({"ray": {"nn": 2}}, r"trainer.runners.ray: unknown setting 'nn'; known: address,"),
        ({"ray": {"n": 2.5}}, r"trainer.runners.ray: n: a number of runners"),
        ({"ray": {"strategy": "PACK"}}, r"trainer.runners.ray: RayRunners: strategy 'PACK'"),
        ({"ray": [1]}, r"trainer.runners.ray: a mapping of RayRunners settings"),
    ],
)
def test_voltrl_train_names_the_bad_runners_setting(runners, message, tmp_path, importable_ray):
    with pytest.raises(VoltRLError, match=message):
        build_from_config(config(runners, tmp_path))


def test_voltrl_train_without_ray_says_which_extra_to_install(tmp_path, no_ray):
    with pytest.raises(VoltRLError, match=r"voltrl\[ray\]"):
        build_from_config(config("ray", tmp_path))


def test_ray_runners_settings_round_trip_through_train_yaml():
    runners = vl.RayRunners(
        n=3,
        address="auto",
        max_concurrency=8,
        num_cpus=2,
        resources={"agents": 1},
        runtime_env={"working_dir": "."},
        max_restarts=-1,
    )
    assert vl.RayRunners.from_config(runners.config()) == runners
    # a function n, which YAML cannot hold, is left out
    assert "n" not in vl.RayRunners(n=lambda backlog: 2).config()
