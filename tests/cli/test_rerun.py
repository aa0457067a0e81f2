"""A run's ``train.yaml`` runs it again: it names the model and the store as the run got them
(a local path made absolute), a model object or an agent built with arguments leaves a field to
fill in, and ``voltrl train`` refuses a config that cannot run in one line naming the field, before
any run directory exists."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import TESTS, voltrl

import voltrl as vl
from voltrl.cli.main import main as voltrl_main
from voltrl.runtime.dataset import load_tasks

AGENTS = TESTS / "serving_agents.py"


class NeedsAServer(vl.LitAgent):
    """An agent built with an argument: importing its class cannot build it again."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url

    async def rollout_async(self, task: Any, resources: Any, rollout: Any) -> float:
        return 0.0


def a_config(tmp_path: Path, **algorithm: Any) -> dict[str, Any]:
    """A config that runs (LocalRL on the tiny model), with ``algorithm`` on top."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"q": 1}\n')
    return {
        "agent": f"{AGENTS}:calls_once",
        "data": {"train": str(data)},
        "algorithm": {"name": "local_rl", "model": "tiny", "schedule": {"steps": 1}, **algorithm},
        "trainer": {"run_dir": str(tmp_path / "runs"), "name": "again"},
    }


def written_yaml(tmp_path: Path, algorithm: vl.LocalRL, agent: Any) -> tuple[str, dict]:
    """The ``train.yaml`` a ``fit`` of ``agent`` with ``algorithm`` writes (its text, parsed)."""
    trainer = vl.Trainer(algorithm, run_dir=tmp_path / "runs", name="written")
    run_dir = tmp_path / "runs" / "written"
    run_dir.mkdir(parents=True)
    tasks = load_tasks([{"q": 1}])
    path = trainer.write_config(run_dir, agent, ([{"q": 1}], tasks), (None, None))
    assert path is not None
    return path.read_text(), yaml.safe_load(path.read_text())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"algorithm": {"model": None}}, "algorithm.model: none given"),
        ({"algorithm": {"model": "/no/such/model"}}, "algorithm.model: the directory /no/such"),
        (
            {"algorithm": {"shedule": 3}},
            "algorithm.shedule: unknown field (did you mean 'schedule'?)",
        ),
        ({"algorithm": {"schedule": {"stepz": 3}}}, "algorithm.schedule.stepz: Extra inputs"),
        ({"algorithm": {"update": {"lr": "fast"}}}, "algorithm.update.lr: Input should be"),
        ({"algorithm": {"trajectory": {"mode": "x"}}}, "algorithm.trajectory.mode: Input"),
        (
            {"algorithm": {"warm_start": {"source": "/no/such/run"}}},
            "algorithm.warm_start.source: store /no/such/run does not exist",
        ),
        ({"algorithm": {"name": "ppo"}}, "algorithm.name: unknown algorithm 'ppo'"),
        ({"data": {"train": "missing.jsonl"}}, "data.train: file missing.jsonl does not exist"),
        ({"data": {"val": "missing.jsonl"}}, "data.val: file missing.jsonl does not exist"),
        ({"trainer": {"max_concurency": 2}}, "trainer.max_concurency: unknown field (did you"),
        ({"trainer": {"resources": {"user_llm": {}}}}, "trainer.resources.user_llm.endpoint:"),
        ({"trainer": {"resources": [{"model": "m"}]}}, "trainer.resources: a mapping of names"),
        ({"agent": "MODULE:AGENT"}, "agent: 'MODULE:AGENT' names no agent"),
        ({"agent": "no_such_module:agent"}, "agent: cannot import module 'no_such_module'"),
        ({"agent": "{tmp}/agents.py:NeedsAServer"}, "agent: cannot build"),
    ],
)
def test_a_config_that_cannot_run_is_one_line_naming_the_field_and_starts_no_run(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: dict[str, Any],
    message: str,
):
    (tmp_path / "agents.py").write_text(
        "import voltrl as vl\n\n\nclass NeedsAServer(vl.LitAgent):\n"
        "    def __init__(self, url):\n        super().__init__()\n"
    )
    config = a_config(tmp_path)
    for section, value in change.items():
        if isinstance(value, dict):
            config[section] = {**config[section], **value}
        else:
            config[section] = value.replace("{tmp}", str(tmp_path))
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    status = voltrl_main(["train", str(tmp_path / "train.yaml")])
    err = capsys.readouterr().err
    assert status == 2 and message in err, err
    assert err.count("\n") == 1 and err.startswith("voltrl: error: ")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_run_given_a_model_object_writes_a_yaml_that_says_so_and_voltrl_train_refuses_it(
    tmp_path: Path,
):
    """The issue's case: a sample passed the model as an object; its ``train.yaml`` said
    ``model: null``, and running it crashed with a traceback after making a failed run."""
    from voltrl.models.tiny import build_tiny

    model, tokenizer = build_tiny(hidden=16, layers=1)
    algorithm = vl.LocalRL(model, tokenizer=tokenizer, schedule={"steps": 1})
    text, config = written_yaml(tmp_path, algorithm, NeedsAServer("http://127.0.0.1:1"))
    assert text.startswith("# Runs this training again once the fields named below are set")
    assert "set algorithm.model to its path or hub name" in text
    assert config["algorithm"]["model"] is None and config["agent"] == "MODULE:AGENT"
    written = tmp_path / "runs" / "written" / "train.yaml"
    before = sorted(p.name for p in (tmp_path / "runs").iterdir())
    out = voltrl("train", str(written), cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("voltrl: error: algorithm.model: none given")
    assert out.stderr.count("\n") == 1
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == before  # no written-2


def test_a_train_yaml_names_a_local_model_by_its_absolute_path_and_runs_as_a_new_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from serving_agents import calls_once

    (tmp_path / "models" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    algorithm = vl.LocalRL("models/mine", schedule={"steps": 1}, checkpoints={"resume": True})
    text, config = written_yaml(tmp_path, algorithm, calls_once)
    assert text.startswith("# Runs this training again: voltrl train ")
    assert "algorithm.checkpoints.resume: true continues this run" in text
    assert config["algorithm"]["model"] == str(tmp_path / "models" / "mine")
    assert config["algorithm"]["checkpoints"]["resume"] is False  # it starts the training again
    assert config["agent"] == f"{AGENTS}:calls_once"
    # "tiny" and hub names stay names
    _, config = written_yaml(tmp_path / "b", vl.LocalRL("tiny"), calls_once)
    assert config["algorithm"]["model"] == "tiny"


def test_a_train_yaml_names_a_relative_store_by_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from serving_agents import calls_once

    monkeypatch.chdir(tmp_path)
    algorithm = vl.LocalRL("tiny", schedule={"steps": 1})
    for store, recorded in [
        ("shared.sqlite", str(tmp_path / "shared.sqlite")),
        ("sqlite:///runs/shared.sqlite", str(tmp_path / "runs" / "shared.sqlite")),
        ("http://127.0.0.1:9/", "http://127.0.0.1:9/"),
    ]:
        trainer = vl.Trainer(algorithm, store=store, run_dir=tmp_path / "runs", name="written")
        run_dir = tmp_path / "runs" / "written"
        run_dir.mkdir(parents=True, exist_ok=True)
        path = trainer.write_config(
            run_dir, calls_once, ([{"q": 1}], load_tasks([{"q": 1}])), (None, None)
        )
        assert path is not None and yaml.safe_load(path.read_text())["trainer"]["store"] == recorded


def test_an_agent_bound_to_a_module_name_is_named_by_it(tmp_path: Path):
    """``calc_agent = calc_agent_at(None)``: a function built in a function, importable by
    the name the module binds it to."""
    from helpers import load_sample

    from voltrl.runtime.run_dir import agent_spec

    agent = load_sample("calc_mcp", "agent")
    assert agent_spec(agent.calc_agent) == f"{agent.__file__}:calc_agent"
    assert agent_spec(agent.calc_agent_at("http://127.0.0.1:1/mcp")) == "MODULE:AGENT"
    assert agent_spec(NeedsAServer("http://127.0.0.1:1")) == "MODULE:AGENT"


SCRIPT = """
import voltrl as vl


@vl.rollout
def agent(task, resources):
    return 1.0


trainer = vl.Trainer(vl.Baseline(), n_runners=1, inline=True, run_dir="runs", name="script")
result = trainer.fit(agent, [{"q": 1}, {"q": 2}])
print("the script's own run:", result.run_dir)
"""


def test_a_script_without_a_main_guard_runs_once_when_its_train_yaml_runs_it_again(
    tmp_path: Path,
) -> None:
    """The quick start's script (a top-level ``fit``, no main guard) run as a user runs it,
    then its run's ``train.yaml``: ``voltrl train`` loads the agent from the script without
    starting the script's own run, so the file's run is the only new one."""
    (tmp_path / "script.py").write_text(SCRIPT)
    first = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert first.returncode == 0, first.stderr
    assert "the script's own run:" in first.stdout
    again = voltrl("train", "runs/script/train.yaml", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "the script's own run:" not in again.stdout
    assert "script.py starts a run of its own when run as a script" in again.stderr
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir() if p.is_dir())
    assert runs == ["script", "script-2"]  # the script's, then the file's: no third


def test_voltrl_dev_of_a_module_that_trains_when_imported_says_so_in_one_line(
    tmp_path: Path,
) -> None:
    (tmp_path / "trains_on_import.py").write_text(SCRIPT)
    (tmp_path / "rows.jsonl").write_text('{"q": 1}\n')
    args = ["--data", "rows.jsonl", "--llm-endpoint", "http://127.0.0.1:9/v1", "--model", "m"]
    out = voltrl("dev", "trains_on_import:agent", *args, cwd=tmp_path)
    assert out.returncode == 2
    assert "starts a run of its own" in out.stderr and "__main__" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "runs").exists()
