"""samples/werewolf's rules, move by move: each test scripts a game (who the werewolves bite,
what the witch and the seer do, how the village votes) through ``Trainer.dev`` against the
scripted backend, then reads back who was asked what and what each player heard. The
``agentscope`` rule set (AgentScope's own game) and the ``short`` one are played side by side
where they differ."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from werewolf_script import (
    agent,
    asked,
    choices_offered,
    game_event,
    heard,
    legal,
    play,
    player_of,
    role_of,
    rules,
    seats,
    system_prompt,
)

from voltrl.models.tiny import build_tiny_tokenizer


def row(rule_set: str, max_rounds: int = 1, **extra) -> dict:
    """One game (one deal) under ``rule_set``; :func:`seats` says who plays what."""
    [game] = agent.game_rows(1, seed=3, rules=rule_set, max_rounds=max_rounds, **extra)
    return game


async def test_day_ballots_and_tally_are_public_and_night_ballots_reach_the_wolves_only(
    tmp_path: Path,
) -> None:
    game = row("agentscope", max_rounds=2)
    result, _store, fb, _ = await play(tmp_path, [game], legal())
    assert result.rollouts[0].status == "succeeded", result.rollouts[0].error
    wolves = seats(game)["werewolf"]
    tallies = [b for b in (r["body"] for r in fb.requests) if "Day 1: The votes: " in heard(b)]
    assert {role_of(b) for b in tallies} > {"werewolf"}  # the village hears it too
    [reading] = {re.search(r"Day 1: The votes: [^\n]*", heard(b)).group(0) for b in tallies}
    assert reading.count(" -> ") == 9 and "(tally: " in reading  # nobody died on night 1
    night = [b for b in (r["body"] for r in fb.requests) if "werewolves: The votes" in heard(b)]
    assert night and {player_of(b) for b in night} <= set(wolves)
    assert f"{wolves[0]} -> " in heard(night[-1]) and "You attack " in heard(night[-1])


async def test_the_pinned_note_keeps_checks_potions_and_votes_that_the_history_dropped(
    tmp_path: Path,
) -> None:
    """A budget of 300 tokens of the tiny model's tokenizer: every prompt's history (before
    the question asked) fits it
    and the first night soon falls out of it, while the seer's check, the witch's potions
    and each player's own ballots stay in the system prompt."""
    game = row("agentscope", max_rounds=3, history_tokens=300, tokenizer="tiny")
    wolf = seats(game)["werewolf"][0]

    def choose(player: str, role: str, prompt: str, choices: list[str]) -> str | None:
        return wolf if role == "seer" and "check" in prompt else None

    result, store, fb, _ = await play(tmp_path, [game], legal(choose=choose))
    event = await game_event(store, result.rollouts[0].rollout_id)
    assert event["history_dropped"] > 0
    tokenizer = build_tiny_tokenizer()
    for request in (r["body"] for r in fb.requests):
        lines = re.findall(r"<history>\n(.*?)\n</history>", heard(request), re.S)
        history = [line for block in lines for line in block.split("\n")][:-1]  # not the question
        assert sum(len(tokenizer(x, add_special_tokens=False).input_ids) for x in history) <= 300
    seer, witch = seats(game)["seer"][0], seats(game)["witch"][0]
    last = {player_of(r["body"]): r["body"] for r in fb.requests}
    assert f"- Night 1: you checked {wolf}: a werewolf." in system_prompt(last[seer])
    assert "Night 1" not in heard(last[seer])  # the note is all that is left of it
    assert "- Potions left: poison." in system_prompt(last[witch])
    assert "- Night 1: you saved " in system_prompt(last[witch])
    assert "- Day 1: you voted " in system_prompt(last[seer])


@pytest.mark.parametrize("rule_set", ["agentscope", "short"])
async def test_the_witch_saves_herself_only_in_the_short_game(tmp_path: Path, rule_set: str):
    game = row(rule_set)
    witch = seats(game)["witch"][0]

    def choose(player: str, role: str, prompt: str, choices: list[str]) -> str | None:
        return witch if "vote whom to kill" in prompt else None

    _result, _store, fb, _ = await play(tmp_path, [game], legal(choose=choose))
    offered = asked(fb, "Use your healing potion?", witch)
    news = [heard(b) for b in asked(fb, "Day 1: your turn to speak.")][-1]
    if rule_set == "agentscope":
        assert not offered and f"Died last night: {witch}." in news
    else:
        assert offered and "Day 1. Nobody died." in news


@pytest.mark.parametrize("rule_set", ["agentscope", "short"])
async def test_the_witch_heals_and_poisons_on_one_night_only_in_the_short_game(
    tmp_path: Path, rule_set: str
) -> None:
    game = row(rule_set)
    witch = seats(game)["witch"][0]
    _result, _store, fb, _ = await play(tmp_path, [game], legal())  # she saves, when asked
    assert asked(fb, "Night 1: the werewolves attack", witch)
    poison = asked(fb, "Night 1: poison someone?", witch)
    assert bool(poison) == (rule_set == "short")


@pytest.mark.parametrize(("rule_set", "verdict"), [("agentscope", "a villager"),
                                                  ("short", "not a werewolf")])  # fmt: skip
async def test_the_seer_learns_the_role_or_only_whether_a_werewolf(
    tmp_path: Path, rule_set: str, verdict: str
) -> None:
    game = row(rule_set)
    villager = seats(game)["villager"][0]

    def choose(player: str, role: str, prompt: str, choices: list[str]) -> str | None:
        return villager if role == "seer" else None

    _result, _store, fb, _ = await play(tmp_path, [game], legal(choose=choose))
    seer = seats(game)["seer"][0]
    after = asked(fb, "Day 1: your turn to speak.", seer)[0]
    assert f"moderator: {villager} is {verdict}." in heard(after)
    assert f"- Night 1: you checked {villager}: {verdict}." in system_prompt(after)


@pytest.mark.parametrize("rule_set", ["agentscope", "short"])
async def test_the_first_nights_victim_speaks_last_words_under_agentscope_rules(
    tmp_path: Path, rule_set: str
) -> None:
    game = row(rule_set)
    victim = seats(game)["villager"][0]

    def choose(player: str, role: str, prompt: str, choices: list[str]) -> str | None:
        if "vote whom to kill" in prompt:
            return victim
        return "pass" if "healing potion" in prompt else None

    _result, _store, fb, _ = await play(tmp_path, [game], legal(choose=choose))
    last_words = asked(fb, "You died in the night: your last words.", victim)
    if rule_set == "short":
        assert not last_words
        return
    [_] = last_words
    first_speaker = asked(fb, "Day 1: your turn to speak.")[0]
    assert f"{victim}: I am {victim} and I trust nobody." in heard(first_speaker)


@pytest.mark.parametrize(
    ("rule_set", "answer", "rounds"),
    [("agentscope", "talk on", 3), ("agentscope", "agree", 1), ("short", "talk on", 1)],
)
async def test_the_werewolves_talk_until_they_agree_or_the_rounds_run_out(
    tmp_path: Path, rule_set: str, answer: str, rounds: int
) -> None:
    game = row(rule_set)

    def choose(player: str, role: str, prompt: str, choices: list[str]) -> str | None:
        return answer if "agree on a victim" in prompt else None

    _result, _store, fb, _ = await play(tmp_path, [game], legal(choose=choose))
    talk = asked(fb, "Night 1, werewolves' talk")
    assert len(talk) == 3 * rounds and {role_of(b) for b in talk} == {"werewolf"}
    asked_to_agree = asked(fb, "Night 1: do the werewolves agree on a victim?")
    assert len(asked_to_agree) == (0 if rule_set == "short" else rounds - (answer == "talk on"))
    last_to_speak = player_of(talk[-1])
    assert {player_of(b) for b in asked_to_agree} <= {last_to_speak}


@pytest.mark.parametrize("rule_set", ["agentscope", "short"])
async def test_a_tied_vote_draws_lots_by_night_and_by_agentscope_day_or_puts_nobody_out(
    tmp_path: Path, rule_set: str
) -> None:
    """The three werewolves bite three players: lots name the victim and the wolves hear it.
    Day 1 ends 4 to 4 (and 1): the agentscope game draws lots, the short game puts nobody
    out."""
    game = row(rule_set, max_rounds=2)  # night 2: the wolves heard the day's reading
    roles = seats(game)
    a, b = roles["werewolf"][0], roles["villager"][0]
    bites = iter(roles["villager"])
    ballots: dict[str, int] = {a: 0, b: 0}

    def choose(player: str, role: str, prompt: str, choices: list[str]) -> str | None:
        if "Night 1: vote whom to kill" in prompt:
            return next(bites)
        if "Day 1: vote to eliminate" in prompt:
            if player == max([*choices, player], key=lambda x: int(x[6:])):  # the last voter
                return next(x for x in choices if x not in (a, b))
            pick = min((x for x in (a, b) if x != player), key=lambda x: ballots[x])
            ballots[pick] += 1
            return pick
        return None

    result, store, fb, _ = await play(tmp_path, [game], legal(choose=choose))
    event = await game_event(store, result.rollouts[0].rollout_id)
    wolf_heard = heard(asked(fb, "Day 1: your turn to speak.", roles["werewolf"][0])[0])
    drawn = re.search(
        r"A tie between [^:]+: (Player\d) is drawn by lot\. You attack \1\.", wolf_heard
    )
    assert drawn, wolf_heard
    after_vote = [
        heard(x) for x in (r["body"] for r in fb.requests) if "Day 1: The votes" in heard(x)
    ]
    tie = re.search(rf"A tie between ({a} and {b}|{b} and {a}): ([^\n]*)", after_vote[-1])
    assert tie, after_vote[-1]
    if rule_set == "short":
        assert tie.group(2).startswith("nobody.") and event["lots_drawn"] == 1
    else:
        [out] = re.findall(r"(Player\d) is drawn by lot\. \1 is eliminated\.", after_vote[-1])
        assert out in (a, b) and event["lots_drawn"] == 2
        assert asked(fb, "You are eliminated: your last words.", out)


async def test_a_game_the_round_cap_ends_is_a_draw_for_both_sides(tmp_path: Path) -> None:
    assert rules.RULESETS["agentscope"].max_rounds == 30 and rules.RULESETS["short"].max_rounds == 4
    assert "after 30 rounds it is a draw" in agent.rules_prompt(rules.RULESETS["agentscope"])
    game = row("agentscope", max_rounds=1, outcome={"wolves": {"draw": -0.5}})
    result, store, fb, _ = await play(tmp_path, [game], legal())
    event = await game_event(store, result.rollouts[0].rollout_id)
    assert event["winner"] == "draw" and event["rounds"] == 1 and event["rules"] == "agentscope"
    outcomes = {r.name: r.value for r in await store.get_rewards(result.rollouts[0].rollout_id)}
    assert outcomes == {"outcome/wolves": -0.5, "outcome/village": 0.0}
    assert asked(fb, "Day 1: vote to eliminate.")  # the game had its day, then ended


def test_an_unknown_rule_set_is_refused_when_the_rows_are_made() -> None:
    with pytest.raises(ValueError, match=r"no rule set 'classic' \(known: agentscope, short\)"):
        agent.game_rows(1, rules="classic")


@pytest.mark.parametrize("rule_set", ["agentscope", "short"])
async def test_the_werewolves_may_bite_one_of_their_own_only_under_agentscope_rules(
    tmp_path: Path, rule_set: str
) -> None:
    game = row(rule_set)
    wolves = seats(game)["werewolf"]
    bite = asked(fb := (await play(tmp_path, [game], legal()))[2], "vote whom to kill.")
    offered = {name for b in bite for name in choices_offered(b)}
    assert len(bite) == 3 and {role_of(b) for b in bite} == {"werewolf"}
    if rule_set == "agentscope":
        assert set(wolves) <= offered
    else:
        assert not set(wolves) & offered and len(offered) == 6
    assert not asked(fb, "vote whom to kill.", seats(game)["seer"][0])


@pytest.mark.parametrize(("death", "shoots"), [("bitten", True), ("poisoned", False),
                                               ("voted out", True)])  # fmt: skip
async def test_the_hunter_shoots_as_he_dies_unless_poisoned(
    tmp_path: Path, death: str, shoots: bool
) -> None:
    """Bitten at night (the witch passes) or voted out by day he takes someone with him (the
    first villager, who is then dead: the next night's choices leave both out); poisoned he
    does not."""
    game = row("agentscope", max_rounds=2 if death == "voted out" else 1)
    roles = seats(game)
    hunter, target = roles["hunter"][0], roles["villager"][0]

    def choose(player: str, role: str, prompt: str, choices: list[str]) -> str | None:
        if "vote whom to kill" in prompt:
            if "Night 1" in prompt:
                bites = {"bitten": hunter, "poisoned": target}
                return bites.get(death, roles["villager"][1])
            return None
        if "healing potion" in prompt:  # voted out: she saves, so that the game goes on
            return "save" if death == "voted out" else "pass"
        if "poison someone" in prompt:
            return hunter if death == "poisoned" else "nobody"
        if "vote to eliminate" in prompt and death == "voted out":
            return hunter if player != hunter else None
        if "shoot someone" in prompt:
            return target
        return None

    _, _, fb, _ = await play(tmp_path, [game], legal(choose=choose))
    shot = asked(fb, "You are dying: shoot someone?", hunter)
    assert len(shot) == int(shoots)
    if death == "voted out":
        night_2 = asked(fb, "Night 2: vote whom to kill.")
        assert night_2 and all(f"The hunter shot {target}." in heard(b) for b in night_2)
        assert not {target, hunter} & {x for b in night_2 for x in choices_offered(b)}
    elif shoots:
        news = heard(asked(fb, "Day 1: your turn to speak.")[0])
        assert f"Died last night: {hunter}, {target}." in news
        assert "nobody" in choices_offered(shot[0]) and hunter not in choices_offered(shot[0])
    else:
        news = heard(asked(fb, "Day 1: your turn to speak.")[0])
        assert f"Died last night: {target}, {hunter}." in news
