"""samples/werewolf: nine AgentScope players run whole games through ``Trainer.dev`` against a
scripted backend that plays legal moves; mixed models route to two endpoints; each side's
outcome lands on its own calls and penalties on the call that earned them; a side filter
keeps only that side's trained calls; a refused prompt does not stop the game."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from fake_openai_backend import FakeBackend
from helpers import fake_trainer
from werewolf_script import (
    agent,
    choices_offered,
    game_event,
    legal,
    play,
    player_of,
    prompt_of,
    rules,
    seats,
)

import voltrl as vl
from voltrl.store.memory import InMemoryStore
from voltrl.trajectory import TrajectoryConfig, collate, trajectories_from_store


async def test_a_game_of_nine_runs_to_a_winner(tmp_path: Path) -> None:
    [row] = agent.game_rows(1, seed=3, max_rounds=8)
    result, store, _, opponent = await play(tmp_path, [row], legal())
    [rollout] = result.rollouts
    assert rollout.status == "succeeded", rollout.error
    game = await game_event(store, rollout.rollout_id)
    state = rules.deal(row["seed"])
    assert game["winner"] in ("wolves", "village")
    assert game["invalid_outputs"] == 0 and game["rounds"] >= 2
    assert sorted(game["roles"].values()) == sorted(rules.ROLES_9)
    assert game["roles"] == {p.name: p.role for p in state.players}
    assert rollout.reward == (1.0 if game["winner"] == "village" else 0.0)
    calls = await store.get_llm_calls(rollout.rollout_id)
    assert len(calls) > 40 and not opponent.requests  # nobody external in this game
    names = {c.agent_name for c in calls}
    assert names == {agent.agent_name(p, False) for p in state.players}
    spans = {s.name for s in await store.get_spans(rollout.rollout_id)}
    assert {"invoke_agent Player1", "chat fake-model"} <= spans


async def test_external_players_use_the_opponent_model_and_are_never_trained(
    tmp_path: Path,
) -> None:
    rows = agent.game_rows(2, seed=5, external={"side": "wolves"}, max_rounds=8)
    result, store, fb, opponent = await play(tmp_path, rows, legal())
    assert fb.requests and opponent.requests
    assert {r["body"]["model"] for r in opponent.requests} == {"hosted-model"}
    for rollout in result.rollouts:
        roles = (await game_event(store, rollout.rollout_id))["roles"]
        calls = await store.get_llm_calls(rollout.rollout_id)
        for c in calls:
            player = c.agent_name.rsplit("/", 1)[1]
            wolf = roles[player] == "werewolf"
            assert c.agent_name.startswith("external/wolves/" if wolf else "policy/village/")
    for train in ("wolves", "both", "village"):
        config = TrajectoryConfig(agent_filter=agent.side_filter(train))
        batch = collate(await trajectories_from_store(store, result.rollouts, config), config)
        sides = {name.split("/")[1] for name in batch.agent_names}
        assert all(name.startswith("policy/") for name in batch.agent_names)
        assert sides == ({"village"} if train != "wolves" else set())
        if train == "wolves":  # every wolf is external: nothing of theirs trains
            assert batch.stats["dropped/no_trainable_calls"] == 2


async def test_each_side_gets_its_outcome_and_penalties_land_on_their_call(tmp_path: Path):
    """Player1 answers every choice outside the legal ones: each of those calls is
    penalised, no other call is, and each team's calls carry the team's outcome (a lost game
    costs -1 here and an invalid answer -1.5: the outcome's values and the penalty are the
    row's)."""
    lost = {"loss": -1.0}
    [row] = agent.game_rows(
        1, seed=3, max_rounds=8, outcome={"wolves": lost, "village": lost}, invalid_penalty=-1.5
    )
    result, store, *_ = await play(tmp_path, [row], legal(invalid_from="Player1"))
    [rollout] = result.rollouts
    game = await game_event(store, rollout.rollout_id)
    assert game["invalid_outputs"] > 0
    config = TrajectoryConfig(
        agent_filter=agent.side_filter("both"), credit="per_step", gamma=0.0,
        per_step_add_final=True,
    )  # fmt: skip
    [traj] = await trajectories_from_store(store, [rollout], config)
    winner = game["winner"]

    def outcome_of(side: str) -> float:
        return 1.0 if side == winner else -1.0

    for row_ in traj.transitions:
        side, player = row_.agent_name.split("/")[1], row_.agent_name.split("/")[3]
        outcome = outcome_of(side)
        assert row_.reward in (outcome, pytest.approx(outcome - 1.5))
        if row_.reward != outcome:
            assert player == "Player1"
    penalised = [r for r in traj.transitions if r.reward != outcome_of(r.agent_name.split("/")[1])]
    assert len(penalised) == game["invalid_outputs"]


async def test_a_failed_answer_leaves_the_players_memory(tmp_path: Path) -> None:
    """Player1 answers every choice outside the legal ones: each question of his is asked
    with none of his failed answers (nor AgentScope's tool errors about them) before it."""
    [row] = agent.game_rows(1, seed=3, max_rounds=8)
    result, store, fb, _ = await play(tmp_path, [row], legal(invalid_from="Player1"))
    assert result.rollouts[0].status == "succeeded", result.rollouts[0].error
    game = await game_event(store, result.rollouts[0].rollout_id)
    choices, _, at_random = (sum(a[i] for a in game["answers"].values()) for i in (0, 1, 2))
    assert at_random > 0  # Player1's choices, played at random
    assert game["legal_choices"] == (choices - at_random) / choices  # the charted share
    questions = [
        b for b in (r["body"] for r in fb.requests)
        if player_of(b) == "Player1" and choices_offered(b) is not None
    ]  # fmt: skip
    assert len(questions) >= 3
    for body in questions:
        said = [json.dumps(m) for m in body["messages"]]
        asked = max(i for i, m in enumerate(said) if "Choose one of:" in m)
        assert not [m for m in said[:asked] if "Nobody99" in m or "validation failed" in m]


async def test_a_choice_against_the_other_side_earns_the_choice_reward_on_its_call(
    tmp_path: Path,
) -> None:
    """With ``choice_reward`` 0.5, each call that votes out, bites, poisons or shoots a player
    of the other side carries 0.5 beside its side's outcome (a lost game costs -1 here), and
    no other call does: not a vote or a bite against one's own side, a check, a save, a
    speech, nor a choice played at random after invalid answers (a villager's, here)."""
    lost = {"loss": -1.0}
    [row] = agent.game_rows(
        1, seed=3, max_rounds=8, outcome={"wolves": lost, "village": lost}, choice_reward=0.5
    )
    wolves, garbled = seats(row)["werewolf"], seats(row)["villager"][0]

    def choose(player: str, role: str, prompt: str, choices: list[str]) -> str | None:
        if "poison someone" in prompt or "shoot someone" in prompt:
            return next((x for x in choices if x in wolves), None)
        if "vote whom to kill" in prompt and player == wolves[0]:  # a bite on a packmate
            return next(x for x in choices if x in wolves and x != player)
        return None

    script = legal(invalid_from=garbled, choose=choose)
    result, store, fb, _ = await play(tmp_path, [row], script)
    [rollout] = result.rollouts
    assert rollout.status == "succeeded", rollout.error
    game = await game_event(store, rollout.rollout_id)
    side = {name: rules.side_of(role) for name, role in game["roles"].items()}
    config = TrajectoryConfig(
        agent_filter=agent.side_filter("both"), credit="per_step", gamma=0.0,
        per_step_add_final=True,
    )  # fmt: skip
    [traj] = await trajectories_from_store(store, [rollout], config)
    removing = ("vote to eliminate", "vote whom to kill", "poison someone", "shoot someone")
    rewarded: dict[str, int] = {}
    own_side = 0
    # one call a request, in order: the game asks one player at a time
    for body, call in zip((r["body"] for r in fb.requests), traj.transitions, strict=True):
        player = player_of(body)
        assert call.agent_name.endswith(f"/{player}")
        extra = call.reward - (1.0 if side[player] == game["winner"] else -1.0)
        if player == garbled:  # its choices: penalties, then a choice at random
            assert extra in (0.0, pytest.approx(-0.2))
            continue
        asked = next((k for k in removing if k in prompt_of(body)), None)
        if asked is None or choices_offered(body) is None:
            assert extra == 0.0
            continue
        target = json.loads(script(body)["arguments"])["target"]
        against = target in side and side[target] != side[player]
        assert extra == (0.5 if against else 0.0), (asked, player, target)
        rewarded[asked] = rewarded.get(asked, 0) + against
        own_side += target in side and not against
    assert own_side > 0  # votes for one's own side (the script's first choices), a packmate bitten
    assert {k for k, n in rewarded.items() if n} >= {
        "vote to eliminate", "vote whom to kill", "poison someone"
    }  # fmt: skip


def test_a_reward_out_of_its_range_is_refused_when_the_rows_are_made() -> None:
    for bad in (0.5, float("nan"), -float("inf")):
        must = rf"invalid_penalty must be finite and at most 0, not {bad}"
        with pytest.raises(ValueError, match=must):
            agent.game_rows(1, invalid_penalty=bad)
    for bad in (-0.5, float("nan"), float("inf")):
        must = rf"choice_reward must be finite and at least 0, not {bad}"
        with pytest.raises(ValueError, match=must):
            agent.game_rows(1, choice_reward=bad)


async def test_a_refused_prompt_is_an_invalid_choice_and_the_game_goes_on(tmp_path: Path):
    [row] = agent.game_rows(1, seed=3, max_rounds=8)
    store = InMemoryStore()
    async with FakeBackend() as fb:
        fb.script = legal()
        fb.fail_next(400, 400, message="This model's maximum context length is 4096 tokens.")
        trainer = fake_trainer(store, tmp_path, vl.LLM(endpoint=fb.url, model="fake-model"))
        result = await trainer.dev_async(agent.werewolf_game, [row])
    [rollout] = result.rollouts
    assert rollout.status == "succeeded", rollout.error
    game = await game_event(store, rollout.rollout_id)
    assert game["context_overflows"] == 2 and game["winner"] in ("wolves", "village")
    [traj] = await trajectories_from_store(store, [rollout], TrajectoryConfig())
    assert traj.stats["refused/context_length_exceeded"] == 2


def test_rules_win_checks_and_vote_counts() -> None:
    import random

    state = rules.deal(0)
    assert state.winner() is None and len(state.alive("wolves")) == 3
    for p in state.alive("village")[:3]:
        state.kill(p.name)
    assert state.winner() == "wolves"
    state = rules.deal(0)
    for p in state.alive("wolves"):
        state.kill(p.name)
    assert state.winner() == "village"
    count = rules.count_votes({"a": "x", "b": "y", "c": "x"})
    assert count.top == ["x"] and count.public() == "a -> x, b -> y, c -> x (tally: x 2, y 1)"
    assert rules.outcome(count, "nobody", random.Random(0)) == ("x", False)
    tie = rules.count_votes({"a": "y", "b": "x", "c": "z"})
    assert tie.top == ["y", "x", "z"]  # in the order the ballots first name them
    assert rules.outcome(tie, "nobody", random.Random(0)) == (None, False)
    drawn = {rules.outcome(tie, "draw_lots", random.Random(seed))[0] for seed in range(20)}
    assert drawn == {"x", "y", "z"}  # each of the tied, by the seed's lot
    assert rules.outcome(tie, "draw_lots", random.Random(7)) == rules.outcome(
        tie, "draw_lots", random.Random(7)
    )
    assert rules.outcome(rules.count_votes({}), "draw_lots", random.Random(0)) == (None, False)


def test_the_report_splits_validation_by_the_weights_it_was_played_with() -> None:
    """A resumed run repeats its first validation under a newer resources version with the
    same weights: still "before"; without known weights the versions' order decides."""
    from report import when_played

    def game(version: int, weights: int | None) -> dict:
        return {"mode": "val", "version": version, "weights": weights}

    games = [game(2, 0), game(5, 0), game(8, 1), {"mode": "train", "version": 6, "weights": 0}]
    when_played(games)
    assert [g["mode"] for g in games] == ["val before", "val before", "val after", "train"]
    games = [game(2, None), game(5, None)]
    when_played(games)
    assert [g["mode"] for g in games] == ["val before", "val after"]


@pytest.mark.timeout(600)
def test_run_py_trains_both_sides_on_localrl_with_a_warning_and_a_grpo_group_per_side(
    tmp_path: Path,
) -> None:
    """``run.py train --train both`` on the tiny model: one step of one round-long games
    through the store, the gateway, LocalRL's engine and a real policy update; it warns that
    the published work trained one side per run, groups each side's calls apart, counts the
    history in the tiny tokenizer's tokens, and its report names what the side filter and
    the caps left out, the wolves' win rate with its interval and the draw rate."""
    import subprocess
    import sys

    import yaml
    from helpers import SAMPLES

    out = subprocess.run(
        [sys.executable, str(SAMPLES / "werewolf" / "run.py"), "train", "--out", str(tmp_path),
         "--name", "both", "--train", "both", "--max-rounds", "1", "--max-tokens", "8",
         "--n-val", "1", "--max-calls", "16"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "warning: --train both trains the werewolves and the village" in out.stderr
    assert "step 1: " in out.stdout and "trained calls in 2 GRPO group(s); left out" in out.stdout
    assert "over the cap of 16" in out.stdout
    assert "train: 2 game(s), winners" in out.stdout and "draw rate " in out.stdout
    assert re.search(r"the wolves won \d+% \(95% CI \d+%-\d+%\)", out.stdout), out.stdout
    assert "val before: 1 game(s)" in out.stdout and "val after: 1 game(s)" in out.stdout
    assert "remote runners" not in out.stdout + out.stderr  # they are local here
    config = yaml.safe_load((tmp_path / "both" / "train.yaml").read_text())
    assert config["algorithm"]["trajectory"]["group_by_agent"] == agent.SIDE_GROUPS
    [row] = [json.loads(x) for x in (tmp_path / "both" / "val.jsonl").read_text().splitlines()]
    assert (row["rules"], row["tokenizer"], row["max_rounds"]) == ("agentscope", "tiny", 1)


async def test_a_refused_choice_costs_no_penalty_and_is_retried_on_less_memory(tmp_path: Path):
    """The first vote of the game is refused for its length: no call was made, so nobody is
    penalised; the player tries again and the game goes on."""
    refused: list[str] = []

    def first_vote_refused(req: dict[str, Any]) -> dict[str, str]:
        if choices_offered(req) is not None and not refused:
            refused.append(player_of(req))
            return {"error": "This model's maximum context length is 4096 tokens."}
        return legal()(req)

    [row] = agent.game_rows(1, seed=3, max_rounds=8)
    result, store, *_ = await play(tmp_path, [row], first_vote_refused)
    [rollout] = result.rollouts
    game = await game_event(store, rollout.rollout_id)
    assert refused and game["context_overflows"] == 1 and game["invalid_outputs"] == 0
    rewards = await store.get_rewards(rollout.rollout_id)
    assert not [r for r in rewards if r.name == "invalid_output"]
    assert game["winner"] in ("wolves", "village")


def test_legal_answers_count_every_try_and_legal_choices_every_choice() -> None:
    """A seat that met 4 choices, gave 3 invalid answers and had one choice played at random:
    3 legal answers of 6, 3 choices of 4 answered legally; an external seat is left out."""
    from report import summary

    game = {
        "winner": "wolves",
        "roles": {"Player1": "werewolf", "Player2": "seer"},
        "answers": {"Player1": [4, 3, 1], "Player2": [5, 5, 5]},
        "external_seats": ["Player2"],
    }
    figures = summary([game], "wolves")
    assert figures["legal"] == 3 / 6 and figures["legal_choices"] == 3 / 4
    assert figures["answers_by_role"] == {"werewolf": [3, 6]}
