"""samples/werewolf/recipe.py end to end, shrunk: the teacher's games recorded, the warm start
on the trained side's calls, the validation before, two RL steps against the teacher playing
the other side, the validation after, and the row ``benchmarks/learning.py`` tabulates.
Plumbing, not learning: the tiny student is one layer of random weights warmed up for two
steps, so its answers are nonsense and nothing here depends on what it says."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import ROOT

from voltrl.store.sql import SQLStore


@pytest.fixture(autouse=True)
def _benchmarks_and_samples_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """``learning`` (benchmarks/) and ``recipe_runner`` (samples/), for this module's tests."""
    monkeypatch.syspath_prepend(str(ROOT / "samples"))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))


def shrunk(side: str) -> Any:
    """The tiny recipe of ``side`` with 3 teacher deals, 2 SFT steps of 4 calls, 2 RL steps of
    one deal x 2 games and 2 held-out deals, every game one round long (then a draw), on a
    one-layer student writing at most 8 tokens a call."""
    from learning import load_recipe

    recipe = load_recipe("werewolf", "tiny", side)
    tasks = recipe.tasks

    def few(seed: int) -> tuple[list, list, list]:
        return tuple(
            [{**row, "max_rounds": 1} for row in rows[:n]]
            for rows, n in zip(tasks(seed), (3, 4, 2), strict=True)
        )

    sampling = {"temperature": 1.0, "max_tokens": 8}
    return dataclasses.replace(
        recipe,
        tasks=few,
        model={"hidden": 64, "layers": 1},
        sft={**recipe.sft, "steps": 2, "batch_size": 4, "warmup_steps": 1},
        rl=recipe.rl
        | {
            "schedule": {"steps": 2, "tasks_per_step": 1, "group_size": 2},
            "validation": {"sampling": sampling, "every": 2, "n": 1},
            "sampling": sampling,
        },
        concurrency=4,
    )


async def _calls(run_dir: Path) -> dict[str, list[Any]]:
    """The run's recorded calls by rollout mode."""
    store = SQLStore(run_dir / "store.sqlite")
    try:
        out: dict[str, list[Any]] = {}
        for r in await store.query_rollouts():
            out.setdefault(r.mode, []).extend(await store.get_llm_calls(r.rollout_id))
        return out
    finally:
        await store.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_recipe_warms_up_on_the_teachers_wolves_then_trains_them_against_the_teacher(
    tmp_path: Path,
) -> None:
    from learning import table_lines
    from recipe_runner import run_recipe

    recipe = shrunk("wolves")
    row = run_recipe(recipe, 0, tmp_path)
    run_dir = Path(row["run_dir"])
    assert run_dir.name == "werewolf-wolves-recipe-seed0"
    assert (row["sample"], row["variant"], row["side"], row["model"]) == (
        "werewolf", "wolves", "wolves", "tiny"
    )  # fmt: skip

    # the teacher played every seat of its 3 deals; the warm start trained on the wolves' calls
    [teacher_dir] = [p for p in tmp_path.glob("werewolf-wolves-teacher0-*") if p.is_dir()]
    assert json.loads((teacher_dir / "teacher.done").read_text())["tasks"] == 3
    teacher_calls = asyncio.run(_calls(teacher_dir))["dev"]
    assert {c.agent_name.split("/")[1] for c in teacher_calls} == {"wolves", "village"}
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics if "sft/loss" in m] == [1, 2]
    [sft] = [m for m in metrics if "sft/summary/agents" in m]
    assert sft["sft/summary/agents"] and all(
        a.startswith("policy/wolves/") for a in sft["sft/summary/agents"]
    )
    assert row["sft_rows"] > 0 and row["sft_tokens"] > 0

    # two RL steps of one deal x 2 games: the wolves on the student, the village on the teacher
    steps = [m for m in metrics if "train/reward_mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert row["rl_groups"]["groups"] == 2
    assert 0 <= row["rl_groups"]["groups_mixed"] <= 2 and len(row["adv_tokens"]) == 2
    calls = asyncio.run(_calls(run_dir))
    for mode in ("train", "val"):
        sides = {(c.agent_name.split("/")[0], c.agent_name.split("/")[1]) for c in calls[mode]}
        assert sides == {("policy", "wolves"), ("external", "village")}
        for c in calls[mode]:  # the student's calls carry its token ids, the teacher's none
            assert (c.prompt_token_ids is not None) == c.agent_name.startswith("policy/")

    # the held-out deals before and after, with the figures the table reports
    for phase in ("before", "after"):
        figures = row[phase]
        assert figures["games"] == 2 and figures["draws"] + figures["wins"] <= 2
        low, high = figures["ci95"]
        assert 0.0 <= low <= figures["win_rate"] <= high <= 1.0
        assert figures["draw_rate"] == figures["draws"] / 2
        assert set(figures["legal_by_role"]) == {"werewolf"}  # the student's seats only
        assert 0.0 <= figures["legal"] <= 1.0
        assert set(figures["behaviour"]) == {
            "seer revealed", "wolves bite the revealed seer", "village votes a revealed werewolf"
        }  # fmt: skip
    assert 0.0 <= row["p_value"] <= 1.0 and row["unfinished"] == 0
    assert json.loads((run_dir / "recipe.json").read_text())["after"] == row["after"]

    [line] = [x for x in table_lines([row]) if x.startswith("| werewolf")]
    assert line.startswith("| werewolf (wolves) | AgentScope 2.x | 0 |")
    [line] = recipe.table_lines([row])[2:]
    assert line.startswith("| wolves | tiny | 0 | 2 / 2 | ")


def test_the_recipes_train_the_side_named_against_the_teacher() -> None:
    """``--side`` picks the side the warm start and RL train, the other side is the teacher's
    on every training and held-out deal, and the three sets of deals share none."""
    from learning import load_recipe

    for model in ("tiny", "smollm2-135m-instruct"):
        for side, other in (("wolves", "village"), ("village", "wolves")):
            recipe = load_recipe("werewolf", model, side)
            assert recipe.variant == side and recipe.sft["agents"] == f"policy/({side})/[^/]+/[^/]+"
            assert recipe.rl["trajectory"]["agent_filter"] == recipe.sft["agents"]
            teacher, train, val = recipe.tasks(1)
            assert all(r["external"] is None for r in teacher)
            assert all(r["external"] == {"side": other} for r in train + val)
            assert all(r["train"] == side for r in teacher + train + val)
            deals = [{r["seed"] for r in rows} for rows in (teacher, train, val)]
            assert not (deals[0] & deals[1] or deals[0] & deals[2] or deals[1] & deals[2])
            assert recipe.tasks(0)[2] == val  # the same held-out deals for every seed
    with pytest.raises(SystemExit, match="--side is for werewolf's recipes; sql_agent has none"):
        load_recipe("sql_agent", "tiny", "wolves")


def test_two_proportions_and_the_behaviour_read_from_a_game_log() -> None:
    """The z-test against a worked example, and each behaviour figure counted on a log."""
    from helpers import load_sample

    report = load_sample("werewolf", "report")
    z, p = report.two_proportions(44, 100, 60, 100)  # pooled 0.52: se 0.0707, z 2.26
    assert z == pytest.approx(2.2646, abs=1e-3) and p == pytest.approx(0.0235, abs=1e-3)
    assert report.two_proportions(0, 10, 0, 10) == (0.0, 1.0)
    roles = {"P1": "seer", "P2": "werewolf", "P3": "villager", "P4": "werewolf"}
    alive = list(roles)

    def vote(when: str, out: str, ballots: dict[str, str], alive: list[str]) -> dict[str, Any]:
        return {"kind": "vote", "when": when, "ballots": ballots, "out": out, "alive": alive}

    def speech(who: str, text: str) -> dict[str, Any]:
        return {"kind": "speech", "when": "Day 1", "who": who, "text": text}

    log = [
        vote("Night 1", "P3", {}, alive),
        speech("P1", "I am the seer. P2 is a werewolf."),
        speech("P4", "P1 is a werewolf."),
        vote("Day 1", "P2", {"P1": "P2", "P3": "P4", "P4": "P1"}, alive),
        vote("Night 2", "P1", {}, ["P1", "P4"]),
    ]
    facts = report.behaviour([{"roles": roles, "log": log}])
    assert facts == {
        "seer revealed": (1, 1),
        "wolves bite the revealed seer": (1, 1),  # night 2; night 1 came before she said so
        "village votes a revealed werewolf": (1, 2),  # P1 and P3 voted; a wolf's ballot is not
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_py_trains_a_side_warmed_up_on_teacher_games_against_the_teacher(
    tmp_path: Path,
) -> None:
    """The recipe's phases by hand: ``dev --teacher`` records the teacher's games, ``train
    --opponent-teacher --warm-start`` warms the tiny model up on the village's calls of them
    and trains it against the teacher's wolves; the report gives the legal answers of the
    student's seats by role."""
    import re
    import subprocess
    import sys

    run_py = [sys.executable, str(ROOT / "samples" / "werewolf" / "run.py")]
    common = ["--out", str(tmp_path), "--max-rounds", "1", "--tokenizer", "tiny"]
    dev = subprocess.run(
        [*run_py, "dev", "--teacher", "--games", "2", "--name", "teacher", *common],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert dev.returncode == 0, dev.stderr[-3000:]
    train = subprocess.run(
        [*run_py, "train", "--train", "village", "--opponent-teacher", "--warm-start",
         str(tmp_path / "teacher"), "--sft-steps", "2", "--max-tokens", "8", "--n-val", "1",
         "--max-calls", "8", "--name", "village", *common],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    metrics = [json.loads(x) for x in (tmp_path / "village" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics if "sft/loss" in m] == [1, 2]
    [sft] = [m for m in metrics if "sft/summary/agents" in m]
    assert all(a.startswith("policy/village/") for a in sft["sft/summary/agents"])
    assert "val before: 1 game(s)" in train.stdout and "val after: 1 game(s)" in train.stdout
    [roles] = re.findall(r"val before: .*\n  legal answers by role \(the seats on the run's "
                         r"model\): (.*)\n", train.stdout)  # fmt: skip
    assert "werewolf" not in roles and "villager" in roles  # the wolves are the teacher's
    assert "wolves bite the revealed seer" in train.stdout

    both = subprocess.run(
        [*run_py, "train", "--opponent-teacher", "--opponent-endpoint", "http://x/v1",
         "--opponent-model", "m", *common],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert both.returncode == 2 and "--opponent-teacher plays instead of" in both.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_levers_script_trains_from_one_warm_start_with_the_levers_it_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``benchmarks/werewolf_levers.py`` on the shrunk recipe: the seed's warm start made once
    (a second call reuses it), one RL step whose training games sample at the lever's
    temperature and carry its choice reward, while the held-out games keep the recipe's
    sampling; the row records the levers and the recipe's figures, the table shows it."""
    import learning
    import werewolf_levers
    from recipe_runner import warm_up

    recipe = shrunk("wolves")
    monkeypatch.setattr(learning, "load_recipe", lambda *args, **kwargs: recipe)
    werewolf_levers.main(
        ["--out", str(tmp_path), "--steps", "1", "--group-size", "2", "--games-per-step", "2",
         "--train-temperature", "1.3", "--choice-reward", "0.5", "--val-deals", "1"]
    )  # fmt: skip
    [row] = [json.loads(x) for x in (tmp_path / "learning" / "werewolf-levers.jsonl").open()]
    assert row["levers"]["train_temperature"] == 1.3 and row["levers"]["lr"] is None
    assert row["before"]["games"] == row["after"]["games"] == 1
    assert len(row["entropy"]) == 1 and row["rl_groups"]["groups"] == 1
    warmed = Path(row["warm_start"])
    assert (warmed / "config.json").exists() and warmed.parent.name.startswith(
        "werewolf-wolves-warm-seed0-"
    )
    assert warm_up(recipe, 0, tmp_path) == (warmed, 0.0)  # reused, not trained again

    run_dir = Path(row["run_dir"])
    config = yaml.safe_load((run_dir / "train.yaml").read_text())["algorithm"]
    assert config["sampling"]["temperature"] == 1.3
    assert config["validation"]["sampling"]["temperature"] == 1.0
    for rows in ("train.jsonl", "val.jsonl"):
        assert {json.loads(x)["choice_reward"] for x in (run_dir / rows).open()} == {0.5}
    lines = (tmp_path / "learning" / "werewolf-levers.md").read_text().splitlines()
    assert lines[2].startswith("| wolves | 0 | steps 1, group_size 2, games_per_step 2, ")
    assert "train_temperature 1.3, choice_reward 0.5 |" in lines[2]
    assert lines[2] in capsys.readouterr().out


def test_the_levers_script_refuses_a_lever_out_of_its_range(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import werewolf_levers

    for argv, said in [
        (["--choice-reward=-1"], "--choice-reward must be finite and at least 0, not -1.0"),
        (["--invalid-penalty=0.5"], "--invalid-penalty must be finite and at most 0, not 0.5"),
        (["--steps=0"], "--steps must be at least 1 (got 0)"),
    ]:
        with pytest.raises(SystemExit) as exited:
            werewolf_levers.main(argv)
        assert exited.value.code == 2 and said in capsys.readouterr().err
