"""Resuming a run keeps its set-up: a resume whose data, model or algorithm settings differ
from the run's is refused before the run changes, naming each difference with both values;
more steps (and what does not alter the data or the model) may change."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest
from helpers import TESTS
from local_rl_setup import make_algorithm
from rl_agents import ROWS, two_turn_agent

import voltrl as vl
from voltrl._dotted import section
from voltrl.algorithms.local.config import ADDED, FLAT, RESUMABLE, upgraded
from voltrl.algorithms.local.update import PolicyUpdateConfig
from voltrl.errors import VoltRLError
from voltrl.runtime.dataset import load_tasks
from voltrl.runtime.run_setup import check_resume, run_setup
from voltrl.store.sql import SQLStore


def a_trainer(algorithm: vl.LocalRL, tmp_path: Path) -> vl.Trainer:
    return vl.Trainer(
        algorithm, n_runners=1, inline=True, run_dir=tmp_path, name="r", progress=False
    )


def run_files(run_dir: Path) -> dict[str, bytes]:
    """The run's record files, as they are now."""
    names = ("metrics.jsonl", "train.yaml", "train.jsonl", "setup.json")
    return {n: (run_dir / n).read_bytes() for n in names}


def run_records(path: Path) -> list[tuple[str, str, dict]]:
    async def records() -> list[tuple[str, str, dict]]:
        store = SQLStore(path)
        try:
            return [(r.name, r.status, r.config) for r in await store.list_runs()]
        finally:
            await store.close()

    return asyncio.run(records())


def test_a_resume_that_changes_the_data_or_the_model_is_refused_and_more_steps_are_not(
    tmp_path: Path,
):
    a_trainer(make_algorithm(schedule={"steps": 1}), tmp_path).fit(two_turn_agent, ROWS)
    run_dir = tmp_path / "r"
    files, records = run_files(run_dir), run_records(run_dir / "store.sqlite")

    update = PolicyUpdateConfig(lr=1e-2, micro_batch_size=4)
    faster = make_algorithm(schedule={"steps": 2}, checkpoints={"resume": True}, update=update)
    with pytest.raises(VoltRLError) as refused:
        a_trainer(faster, tmp_path).fit(two_turn_agent, ROWS)
    message = str(refused.value)
    assert message.startswith("cannot resume run 'r' with a different set-up: ")
    assert "algorithm.update.lr is 0.01 (the run's: 0.001)" in message
    assert "steps" not in message.split(". Resume")[0]  # more steps are allowed

    other_rows = [*ROWS[:2], {"letter": "z"}, ROWS[3]]
    with pytest.raises(VoltRLError, match=r'train data row 3\.letter is "z" \(the run\'s: "c"\)'):
        a_trainer(
            make_algorithm(schedule={"steps": 2}, checkpoints={"resume": True}), tmp_path
        ).fit(two_turn_agent, other_rows)
    assert run_files(run_dir) == files and run_records(run_dir / "store.sqlite") == records

    result = a_trainer(
        make_algorithm(schedule={"steps": 2}, checkpoints={"resume": True}), tmp_path
    ).fit(two_turn_agent, ROWS)
    assert [m["step"] for m in result.metrics if "update/loss" in m] == [2]
    [(name, status, config)] = run_records(run_dir / "store.sqlite")
    assert (name, status, config["schedule"]["steps"]) == ("r", "finished", 2)  # the steps


def setup_of(rows: list[dict], val: list[dict] | None = None, **trainer: object) -> dict:
    trainer_ = vl.Trainer(**trainer)  # type: ignore[arg-type]
    return run_setup(trainer_, "agents.py:agent", load_tasks(rows), val and load_tasks(val))


def test_the_set_up_compared_names_each_difference_and_lets_what_is_safe_change(tmp_path: Path):
    from voltrl.runtime.run_setup import write_setup

    rows = [{"q": i, "user": "scripted"} for i in range(3)]
    llm = vl.LLM(endpoint="http://127.0.0.1:1/v1", model="customer-a")
    write_setup(tmp_path, setup_of(rows, rows[:1], resources={"user_llm": llm}))
    config = {
        "model": "tiny",
        "schedule": {"steps": 2},
        "validation": {"every": 2},
        "compute": {"threads": 1},
        "update": {"lr": 1e-4},
    }
    tasks = {"train": load_tasks(rows), "val": load_tasks(rows[:1])}

    def check(new_config: dict, setup: dict, tasks: dict = tasks) -> None:
        check_resume("r", tmp_path, config, new_config, setup, tasks, RESUMABLE)

    moved = llm.model_copy(update={"endpoint": "http://127.0.0.1:2/v1"})
    same = setup_of(rows, rows[:1], resources={"user_llm": moved})
    allowed = {"schedule": {"steps": 5}, "validation": {"every": 5}, "compute": {"threads": 2}}
    check({**config, **allowed}, same)
    other_llm = llm.model_copy(update={"model": "customer-b"})
    with pytest.raises(VoltRLError) as refused:
        check({**config, "model": "gpt2"}, setup_of(rows, None, resources={"user_llm": other_llm}))
    said = str(refused.value)
    assert 'algorithm.model is "gpt2" (the run\'s: "tiny")' in said
    assert 'trainer LLM.user_llm.model is "customer-b" (the run\'s: "customer-a")' in said
    assert "val data is none (the run's: 1 row (sha256 " in said
    # without the run's rows at hand, the first row of each, field by field
    policy = [{**r, "user": "main_llm"} for r in rows]
    with pytest.raises(VoltRLError, match=r'train data row 1\.user is "main_llm" \(the run'):
        check(config, setup_of(policy, rows[:1], resources={"user_llm": llm}))


def test_a_run_recorded_before_setup_json_is_checked_on_its_algorithm_alone(tmp_path: Path):
    setup = setup_of([{"q": 1}])
    check_resume("r", tmp_path, {"seed": 0}, {"seed": 0}, setup, {"train": [], "val": None})
    with pytest.raises(VoltRLError, match=r"algorithm\.seed is 1 \(the run's: 0\)"):
        check_resume("r", tmp_path, {"seed": 0}, {"seed": 1}, setup, {"train": [], "val": None})


def test_a_setting_added_since_the_run_was_recorded_counts_as_what_the_run_ran_with(
    tmp_path: Path,
):
    """A run started before ``max_staleness`` (and ``update.behaviour_weight_cap``) existed
    did not record them: it ran synchronously, and resumes so; asynchronously it is a
    different set-up, refused as any other."""
    setup = setup_of([{"q": 1}])
    tasks = {"train": [], "val": None}
    then = upgraded({"seed": 0, "update": {"lr": 1e-4}})
    now = {
        "seed": 0,
        "schedule": {"max_staleness": 0},
        "update": {
            "lr": 1e-4,
            "behaviour_weight_cap": 5.0,
            "behaviour_weight_mode": "tis",
            "rollout_correction": None,
            "rollout_correction_cap": 2.0,
        },
        "serving": {"dtype": None},
        "trajectory": {"group_by_agent": None, "audit": "warn"},
    }
    check_resume("r", tmp_path, then, now, setup, tasks)
    # a run that recorded the decoupled weight's bound by its old name ran with today's tis
    clamped = upgraded({"seed": 0, "update": {"lr": 1e-4, "behaviour_weight_mode": "clamp"}})
    check_resume("r", tmp_path, clamped, now, setup, tasks)
    faster = {**now, "schedule": {"max_staleness": 1}}
    with pytest.raises(
        VoltRLError, match=r"algorithm\.schedule\.max_staleness is 1 \(the run's: 0"
    ):
        check_resume("r", tmp_path, then, faster, setup, tasks)


def test_a_run_recorded_with_the_flat_settings_of_voltrl_0_1_resumes(tmp_path: Path):
    """A run recorded before the settings were grouped (``steps``, ``val_every``... at the
    top of its config) resumes with today's grouped LocalRL: its record is read in today's
    shape, the same set-up passes and more steps are allowed, a changed one is refused."""
    a_trainer(make_algorithm(schedule={"steps": 1}), tmp_path).fit(two_turn_agent, ROWS)
    store_path = tmp_path / "r" / "store.sqlite"

    def flatten() -> dict:  # the record as VoltRL 0.1 wrote it, in the store's own table
        with sqlite3.connect(store_path) as db:
            [(run_id, data)] = db.execute("SELECT run_id, data FROM runs").fetchall()
            run = json.loads(data)
            config = run["config"]
            for dotted in ADDED:  # settings VoltRL 0.1 did not have
                held, name = section(config, dotted)
                if held is not None:
                    held.pop(name, None)
            for key, (group, field) in FLAT.items():
                if field in config.get(group, {}):
                    config[key] = config[group].pop(field)
            for group in ("schedule", "validation", "serving", "compute", "checkpoints"):
                assert not config.pop(group), group
            db.execute("UPDATE runs SET data = ? WHERE run_id = ?", (json.dumps(run), run_id))
        return config

    flat = flatten()
    assert flat["steps"] == 1 and "schedule" not in flat
    with pytest.raises(VoltRLError, match=r"algorithm\.update\.lr is 0\.01 \(the run's: 0\.001\)"):
        changed = make_algorithm(
            schedule={"steps": 2}, checkpoints={"resume": True}, update=PolicyUpdateConfig(lr=1e-2)
        )
        a_trainer(changed, tmp_path).fit(two_turn_agent, ROWS)
    result = a_trainer(
        make_algorithm(schedule={"steps": 2}, checkpoints={"resume": True}), tmp_path
    ).fit(two_turn_agent, ROWS)
    assert [m["step"] for m in result.metrics if "update/loss" in m] == [2]


def test_the_flat_keywords_of_voltrl_0_1_go_into_their_groups_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"steps= is schedule=\{'steps': \.\.\.\}"):
        old = vl.LocalRL("tiny", steps=3, val_every=2, engine="local", checkpoint_every=0)
    new = vl.LocalRL(
        "tiny",
        schedule={"steps": 3},
        validation={"every": 2},
        serving={"engine": "local"},
        checkpoints={"every": 0},
    )
    assert old.config() == new.config()
    same = r"steps and schedule\.steps are the same setting"
    with pytest.raises(ValueError, match=same), pytest.warns(DeprecationWarning):
        vl.LocalRL("tiny", steps=3, schedule={"steps": 4})
    with pytest.raises(TypeError, match="unexpected keyword argument 'stepz'"):
        vl.LocalRL("tiny", stepz=3)
    with pytest.raises(ValueError, match="stepz"):
        vl.LocalRL("tiny", schedule={"stepz": 3})


def test_a_train_yaml_in_either_shape_builds_the_same_local_rl(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from voltrl.cli import build_from_config

    (tmp_path / "train.jsonl").write_text('{"letter": "a"}\n')

    def built(algorithm: dict) -> dict:
        config = {
            "agent": f"{TESTS / 'rl_agents.py'}:two_turn_agent",
            "data": {"train": str(tmp_path / "train.jsonl")},
            "algorithm": {"name": "local_rl", "model": "tiny", **algorithm},
        }
        return build_from_config(config)[0].algorithm.config()

    grouped = built({"schedule": {"steps": 3, "group_size": 2}, "checkpoints": {"keep": 1}})
    flat = built({"steps": 3, "group_size": 2, "keep_checkpoints": 1})
    assert flat == grouped and grouped["schedule"]["group_size"] == 2
    said = "note: algorithm settings are grouped since VoltRL 0.2: steps is schedule.steps, "
    assert said + "group_size is schedule.group_size, keep_checkpoints is checkpoints.keep\n" in (
        capsys.readouterr().err
    )
    with pytest.raises(VoltRLError, match=r"algorithm: steps and schedule\.steps are the same"):
        built({"steps": 3, "schedule": {"steps": 4}})
    with pytest.raises(VoltRLError, match=r"algorithm\.schedule\.group_size: Input should be"):
        built({"schedule": {"group_size": 0}})
    with pytest.raises(
        VoltRLError, match=r"algorithm\.shedule: unknown field \(did you mean 'schedule'\?\)"
    ):
        built({"shedule": {"steps": 3}})


def test_the_set_up_keeps_no_secret_and_a_damaged_one_is_named(tmp_path: Path):
    from voltrl.runtime.run_setup import write_setup

    rows = [{"q": 1}]
    headers = {"extra_headers": {"Authorization": "Bearer sk-secret-123"}, "temperature": 0.5}
    llm = vl.LLM(endpoint="http://127.0.0.1:1/v1", model="m", sampling_parameters=headers)
    setup = setup_of(rows, resources={"llm": llm})
    write_setup(tmp_path, setup)
    text = (tmp_path / "setup.json").read_text()
    assert "sk-secret-123" not in text and '"temperature": 0.5' in text
    tasks = {"train": load_tasks(rows), "val": None}
    check_resume("r", tmp_path, {}, {}, setup_of(rows, resources={"llm": llm}), tasks)

    (tmp_path / "setup.json").write_text(text[: len(text) // 2])  # cut short by a crash
    with pytest.raises(VoltRLError, match=r"cannot resume run 'r': .*setup\.json is damaged"):
        check_resume("r", tmp_path, {}, {}, setup, tasks)


def test_a_model_directory_is_recorded_by_its_absolute_path(tmp_path: Path, monkeypatch):
    (tmp_path / "models" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    relative = vl.LocalRL("models/mine").config()["model"]
    absolute = vl.LocalRL(str(tmp_path / "models" / "mine")).config()["model"]
    assert relative == absolute == str(tmp_path / "models" / "mine")
    assert vl.LocalRL("tiny").config()["model"] == "tiny"
