"""Resuming a run keeps its set-up: a resume whose data, model or algorithm settings differ
from the run's is refused before the run changes, naming each difference with both values;
more steps (and what does not alter the data or the model) may change."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from rl_agents import ROWS, two_turn_agent
from test_local_rl import make_algorithm

import voltrl as vl
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
    a_trainer(make_algorithm(steps=1), tmp_path).fit(two_turn_agent, ROWS)
    run_dir = tmp_path / "r"
    files, records = run_files(run_dir), run_records(run_dir / "store.sqlite")

    update = PolicyUpdateConfig(lr=1e-2, micro_batch_size=4)
    faster = make_algorithm(steps=2, resume=True, update=update)
    with pytest.raises(VoltRLError) as refused:
        a_trainer(faster, tmp_path).fit(two_turn_agent, ROWS)
    message = str(refused.value)
    assert message.startswith("cannot resume run 'r' with a different set-up: ")
    assert "algorithm.update.lr is 0.01 (the run's: 0.001)" in message
    assert "steps" not in message.split(". Resume")[0]  # more steps are allowed

    other_rows = [*ROWS[:2], {"letter": "z"}, ROWS[3]]
    with pytest.raises(VoltRLError, match=r'train data row 3\.letter is "z" \(the run\'s: "c"\)'):
        a_trainer(make_algorithm(steps=2, resume=True), tmp_path).fit(two_turn_agent, other_rows)
    assert run_files(run_dir) == files and run_records(run_dir / "store.sqlite") == records

    result = a_trainer(make_algorithm(steps=2, resume=True), tmp_path).fit(two_turn_agent, ROWS)
    assert [m["step"] for m in result.metrics if "update/loss" in m] == [2]
    [(name, status, config)] = run_records(run_dir / "store.sqlite")
    assert (name, status, config["steps"]) == ("r", "finished", 2)  # the record has the steps


def setup_of(rows: list[dict], val: list[dict] | None = None, **trainer: object) -> dict:
    trainer_ = vl.Trainer(**trainer)  # type: ignore[arg-type]
    return run_setup(trainer_, "agents.py:agent", load_tasks(rows), val and load_tasks(val))


def test_the_set_up_compared_names_each_difference_and_lets_what_is_safe_change(tmp_path: Path):
    from voltrl.runtime.run_setup import write_setup

    rows = [{"q": i, "user": "scripted"} for i in range(3)]
    llm = vl.LLM(endpoint="http://127.0.0.1:1/v1", model="customer-a")
    write_setup(tmp_path, setup_of(rows, rows[:1], resources={"user_llm": llm}))
    config = {"model": "tiny", "steps": 2, "val_every": 2, "threads": 1, "update": {"lr": 1e-4}}
    tasks = {"train": load_tasks(rows), "val": load_tasks(rows[:1])}

    def check(new_config: dict, setup: dict, tasks: dict = tasks) -> None:
        check_resume("r", tmp_path, config, new_config, setup, tasks)

    moved = llm.model_copy(update={"endpoint": "http://127.0.0.1:2/v1"})
    same = setup_of(rows, rows[:1], resources={"user_llm": moved})
    check({**config, "steps": 5, "val_every": 5, "threads": 2}, same)  # allowed changes
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
    then = {"seed": 0, "update": {"lr": 1e-4}}
    now = {"seed": 0, "max_staleness": 0, "update": {"lr": 1e-4, "behaviour_weight_cap": 5.0}}
    check_resume("r", tmp_path, then, now, setup, tasks)
    with pytest.raises(VoltRLError, match=r"algorithm\.max_staleness is 1 \(the run's: 0\)"):
        check_resume("r", tmp_path, then, {**now, "max_staleness": 1}, setup, tasks)


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
