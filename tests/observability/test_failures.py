"""The failure report's pieces: which traceback frames are the agent's, which errors are one."""

from __future__ import annotations

import json
import traceback

from voltrl.observability.failures import agent_frames, error_key, traceback_frames
from voltrl.types import Attempt


def formatted_chained_error() -> str:
    try:
        try:
            {}["key"]
        except KeyError:
            json.loads("{")  # raises inside the standard library, chained to the KeyError
    except ValueError:
        return traceback.format_exc()
    raise AssertionError("expected an error")


def test_agent_frames_are_the_users_of_the_last_exception_and_the_raising_frame():
    frames = traceback_frames(formatted_chained_error())
    assert frames[-1].path.endswith("decoder.py")  # the JSONDecodeError's, not the KeyError's
    shown = agent_frames(frames)
    assert [f.path for f in shown] == [__file__, frames[-1].path]
    assert 'json.loads("{")' in shown[0].text


def attempt(error: str, traceback: str | None = None) -> Attempt:
    return Attempt(
        rollout_id="ro-1",
        index=1,
        worker_id="w",
        lease_expires_at=0.0,
        error=error,
        traceback=traceback,
        status="failed",
    )


def test_errors_are_one_by_type_and_raising_line_or_by_message_up_to_numbers_and_ids():
    tb = formatted_chained_error()
    assert error_key(attempt("JSONDecodeError: a", tb)) == error_key(
        attempt("JSONDecodeError: b", tb)
    )
    assert error_key(attempt("rollout timed out after 5.0 s")) == error_key(
        attempt("rollout timed out after 7.5 s")
    )
    assert error_key(attempt("lease expired (worker w-0 stopped heartbeating)")) == error_key(
        attempt("lease expired (worker w-1 stopped heartbeating)")
    )
    assert error_key(attempt("rollout timed out after 5.0 s")) != error_key(attempt("released"))


def test_an_installed_agent_packages_frames_are_its_own():
    from voltrl.observability.failures import Frame

    site = "/usr/lib/python3/site-packages"
    frames = [
        Frame(f"{site}/voltrl/agent.py", 10, "voltrl"),
        Frame(f"{site}/my_agents/solver.py", 20, "the agent"),
        Frame(f"{site}/httpx/_client.py", 30, "httpx"),
        Frame(f"{site}/json/decoder.py", 40, "raising"),
    ]
    assert [f.text for f in agent_frames(frames)] == ["raising"]
    assert [f.text for f in agent_frames(frames, "my_agents")] == ["the agent", "raising"]


def rewards_some(task: dict, resources: object) -> float | None:
    """Returns the reward for even tasks; for odd ones returns None, emitting a reward for
    one agent only at task 1 (a reward somewhere: not unrewarded) and none at all at 3 and 5."""
    import voltrl as vl

    if task["i"] % 2 == 0:
        return 1.0
    if task["i"] == 1:
        vl.emit_reward(0.5, agents="critic")
    return None


def test_rollouts_without_a_reward_are_warned_about_once_and_counted(tmp_path, capsys):
    import voltrl as vl

    tasks = [{"i": i} for i in range(6)]
    trainer = vl.Trainer(n_runners=1, inline=True, run_dir=tmp_path, name="quiet")
    result = trainer.dev(rewards_some, tasks)
    out = capsys.readouterr().out
    assert out.count("warning: 2 of 6 rollouts finished without any reward") == 1, out
    assert "Return the reward, or call vl.emit_reward(value)" in out
    assert "no reward: 2 of 6 rollouts finished without any" in out
    final = "(3 of 6 rewarded: 3 without a final reward)"  # one has an agent's reward
    assert f"result: reward 1.000 over the dev rollouts {final}" in out
    assert result.stats.succeeded == 6
