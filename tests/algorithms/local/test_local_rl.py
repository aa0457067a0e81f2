"""LocalRL end to end on a tiny model: the plumbing (store, gateway, engine, update).

Learning itself is checked by `make demo` and the benchmarks, not here."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from local_rl_setup import make_algorithm, stored, stored_async
from rl_agents import ROWS, assistant_and_user, reply_then_fail, same_reward, two_turn_agent

import voltrl as vl
from voltrl.algorithms.local.update import PolicyTrainer
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.store.sql import SQLStore
from voltrl.trajectory import TrajectoryConfig


@pytest.mark.slow
def test_local_rl_trains_through_store_gateway_runners_and_engine(tmp_path: Path):
    algo = make_algorithm()
    trainer = vl.Trainer(
        algo, n_runners=1, max_concurrency=8, run_dir=tmp_path, name="e2e", progress=False
    )
    result = trainer.fit(two_turn_agent, ROWS, val_dataset=ROWS[:2])
    assert result.by_mode["train"].rollouts == 8 and result.by_mode["train"].failed == 0
    assert result.by_mode["val"].rollouts == 4  # before the first step and after the last

    rollouts, calls = stored(tmp_path / "e2e" / "store.sqlite")
    train = [r for r in rollouts if r.mode == "train"]
    # every call recorded with the engine's token ids, two per rollout
    assert all(len(calls[r.rollout_id]) == 2 for r in rollouts)
    assert all(c.has_token_ids and c.response_logprobs for cs in calls.values() for c in cs)
    # each step ran on the weights the previous update published
    versions = sorted({r.resources_version for r in train})
    assert len(versions) == 2 and versions[0] < versions[1]
    steps = [m for m in result.metrics if "update/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:  # trajectory mode: one row per rollout, plus one per failed merge
        assert m["update/tokens"] > 0
        assert m["batch/rows"] == 4 + m.get("batch/merge_failures", 0), m
    assert (tmp_path / "e2e" / "checkpoints").is_dir()
    assert (tmp_path / "e2e" / "final" / "config.json").exists()
    assert algo._engine is not None and algo._engine.weights_version == 2


@pytest.mark.slow
def test_local_rl_resumes_from_its_last_checkpoint(tmp_path: Path):
    first = vl.Trainer(
        make_algorithm(schedule={"steps": 1}),
        n_runners=1,
        inline=True,
        run_dir=tmp_path,
        name="r",
        progress=False,
    )
    first.fit(two_turn_agent, ROWS)
    second_algo = make_algorithm(schedule={"steps": 2}, checkpoints={"resume": True})
    second = vl.Trainer(
        second_algo, n_runners=1, inline=True, run_dir=tmp_path, name="r", progress=False
    )
    result = second.fit(two_turn_agent, ROWS)
    steps = [m["step"] for m in result.metrics if "update/loss" in m]
    assert steps == [2]  # step 1 came from the checkpoint
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "update/loss" in x] == [1, 2]


def run_statuses(path: Path) -> list[str]:
    async def statuses() -> list[str]:
        store = SQLStore(path)
        try:
            return [r.status for r in await store.list_runs()]
        finally:
            await store.close()

    return asyncio.run(statuses())


@pytest.mark.slow
def test_a_run_whose_update_fails_keeps_a_checkpoint_of_its_last_step_and_resume_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    """An exception outside the optimizer step (here: out of memory in step 2's update, before
    any weight moved) leaves the weights of step 1: they are checkpointed as step 1, and a
    resumed run trains steps 2 and 3 and saves the final model."""
    updates = 0
    step = PolicyTrainer.step

    def out_of_memory_in_the_second_update(self: PolicyTrainer, batch) -> dict:
        nonlocal updates
        updates += 1
        if updates == 2:
            raise RuntimeError("CUDA out of memory (simulated)")
        return step(self, batch)

    monkeypatch.setattr(PolicyTrainer, "step", out_of_memory_in_the_second_update)
    run = tmp_path / "oom"
    first = make_algorithm(schedule={"steps": 3}, validation={"every": 0}, checkpoints={"every": 0})
    trainer = vl.Trainer(first, n_runners=1, inline=True, run_dir=tmp_path, name="oom")
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.fit(two_turn_agent, ROWS)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000001"]
    assert "failed (RuntimeError): checkpoint of step 1 in" in capsys.readouterr().out
    assert not (run / "final").exists()
    assert run_statuses(run / "store.sqlite") == ["failed"]

    monkeypatch.undo()
    resumed = make_algorithm(
        schedule={"steps": 3}, validation={"every": 0}, checkpoints={"every": 0, "resume": True}
    )
    result = vl.Trainer(
        resumed, n_runners=1, inline=True, run_dir=tmp_path, name="oom", progress=False
    ).fit(two_turn_agent, ROWS)
    assert [m["step"] for m in result.metrics if "update/loss" in m] == [2, 3]
    assert (run / "final" / "config.json").exists()
    assert run_statuses(run / "store.sqlite") == ["finished"]  # the same run, continued
    # the last step is checkpointed too, so the finished run can go on with more steps
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_00000001",
        "step_00000003",
    ]


def test_weights_an_optimizer_step_failed_in_are_not_checkpointed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    """An exception inside ``optimizer.step`` may leave some weights updated and others not:
    no checkpoint holds them, the last one stays the latest, and the console says why."""
    import torch

    steps = 0
    adamw_step = torch.optim.AdamW.step

    def fails_in_the_second(self: torch.optim.AdamW, *args: object, **kwargs: object) -> object:
        nonlocal steps
        steps += 1
        if steps == 2:
            with torch.no_grad():  # half of the update applied
                self.param_groups[0]["params"][0].add_(1.0)
            raise RuntimeError("CUDA out of memory (simulated)")
        return adamw_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", fails_in_the_second)
    algo = make_algorithm(schedule={"steps": 3}, validation={"every": 0}, checkpoints={"every": 1})
    trainer = vl.Trainer(algo, n_runners=1, inline=True, run_dir=tmp_path, name="half")
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.fit(two_turn_agent, ROWS)
    assert [p.name for p in (tmp_path / "half" / "checkpoints").iterdir()] == ["step_00000001"]
    out = capsys.readouterr().out
    assert "no checkpoint of these weights: the update of step 2 failed" in out


def test_local_rl_needs_a_tokenizer_with_a_model_object(tmp_path: Path):
    algo = vl.LocalRL(build_tiny_model(build_tiny_tokenizer(), seed=0), schedule={"steps": 1})
    trainer = vl.Trainer(algo, n_runners=1, inline=True, run_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="tokenizer"):
        trainer.fit(two_turn_agent, ROWS)


def published_weights(path: Path) -> list[int | None]:
    """The weights version of every resources version the run published, in order."""

    async def every() -> list[int | None]:
        store = SQLStore(path)
        try:
            latest = (await store.get_resources()).version
            versions = [await store.get_resources(v) for v in range(1, latest + 1)]
            return [r.items["main_llm"].weights_version for r in versions]
        finally:
            await store.close()

    return asyncio.run(every())


def test_a_first_step_whose_rollouts_all_fail_stops_the_run_before_any_update(tmp_path: Path):
    algo = make_algorithm(schedule={"steps": 2}, validation={"every": 0}, checkpoints={"every": 0})
    trainer = vl.Trainer(algo, n_runners=1, inline=True, run_dir=tmp_path, name="f", progress=False)
    with pytest.raises(vl.TooManyFailuresError, match="all 4 rollouts failed"):
        trainer.fit(reply_then_fail, ROWS)
    assert set(published_weights(tmp_path / "f" / "store.sqlite")) == {0}  # no update served


def test_a_step_whose_rollouts_all_failed_is_not_trained_on(tmp_path: Path, capsys):
    filled = TrajectoryConfig(mode="trajectory", failed_rollouts="fill")  # rows all the same
    algo = make_algorithm(
        schedule={"steps": 2}, validation={"every": 0}, checkpoints={"every": 0}, trajectory=filled
    )
    trainer = vl.Trainer(
        algo, n_runners=1, inline=True, run_dir=tmp_path, name="s", stop_at_failure_rate=None
    )
    result = trainer.fit(reply_then_fail, ROWS)
    assert not [m for m in result.metrics if "update/loss" in m]
    assert set(published_weights(tmp_path / "s" / "store.sqlite")) == {0}  # no new weights
    out = capsys.readouterr().out
    assert out.count("every rollout failed: not trained") == 2


def test_replies_cut_off_at_max_tokens_are_counted_per_step_and_warned_once(tmp_path: Path, capsys):
    """The tiny model seldom ends a reply within 6 tokens: each step counts its selected calls
    and those cut off (as the store records them), and the run warns once, naming the cap,
    though both steps cross the threshold."""
    algo = make_algorithm(validation={"every": 0}, checkpoints={"every": 0})
    trainer = vl.Trainer(algo, n_runners=1, inline=True, run_dir=tmp_path, name="cut")
    result = trainer.fit(two_turn_agent, ROWS)
    out = capsys.readouterr().out
    assert out.count("sampled replies were cut off at their max_tokens (LocalRL's sampling: 6") == 1
    assert 'raise LocalRL(sampling={"max_tokens": ...})' in out
    rollouts, calls = stored(tmp_path / "cut" / "store.sqlite")
    recorded = [c for r in rollouts if r.mode == "train" for c in calls[r.rollout_id]]
    steps = [m for m in result.metrics if "batch/rows" in m]
    assert [m["batch/calls"] for m in steps] == [8, 8] and len(recorded) == 16
    assert all(m["batch/stopped/length"] >= 0.1 * m["batch/calls"] for m in steps)
    assert sum(m["batch/stopped/length"] for m in steps) == sum(
        c.finish_reason == "length" for c in recorded
    )


def test_the_cut_off_warning_needs_a_tenth_of_the_replies_and_names_what_cut_them() -> None:
    from voltrl.algorithms.local.reports import cut_off_warning

    assert cut_off_warning({"calls": 20, "stopped/length": 1}, 0, 64) is None
    assert cut_off_warning({"rows": 3}, 0, 64) is None  # no call (explicit transitions)
    capped = cut_off_warning({"calls": 20, "stopped/length": 2}, 4, 64)
    assert capped and capped.startswith("warning: in step 5, 2 of 20 sampled replies were cut")
    assert "at their max_tokens (LocalRL's sampling: 64," in capped
    uncapped = cut_off_warning({"calls": 20, "stopped/length": 2}, 0, None)
    assert uncapped and "at the end of the model's context (no sampling max_tokens)" in uncapped


def test_steps_whose_groups_all_share_a_reward_say_nothing_was_trained(tmp_path: Path, capsys):
    algo = make_algorithm(schedule={"steps": 2}, validation={"every": 0}, checkpoints={"every": 0})
    trainer = vl.Trainer(algo, n_runners=1, inline=True, run_dir=tmp_path, name="z")
    result = trainer.fit(same_reward, ROWS)
    out = capsys.readouterr().out
    assert out.count("trained 0 tokens with non-zero advantage") == 2
    assert out.count("every group had the same reward") == 1  # warned once
    # no row ran: no tokens-per-second point (it was the batch's tokens over ~0 s, a spike)
    steps = [m for m in result.metrics if "update/tokens" in m]
    assert len(steps) == 2 and not any("update/tokens_per_s" in m for m in steps)
    # the update's activations are said once, at the first update; each step logs the peak
    assert out.count("memory: the update's activations, about ") == 1
    assert all(m["memory/peak_gib"] > 0 for m in steps)


def test_validation_sampling_inherits_the_training_sampling_unless_overridden():
    tok = build_tiny_tokenizer()
    algo = vl.LocalRL(
        build_tiny_model(tok), tokenizer=tok, sampling={"max_tokens": 6, "top_p": 0.9}
    )
    assert algo.val_sampling == {"temperature": 0.0, "max_tokens": 6, "top_p": 0.9}
    algo = vl.LocalRL(
        build_tiny_model(tok),
        tokenizer=tok,
        sampling={"max_tokens": 6},
        validation={"sampling": {"max_tokens": 9}},
    )
    assert algo.val_sampling == {"temperature": 0.0, "max_tokens": 9}


def test_validation_runs_each_held_out_task_val_n_times(tmp_path: Path):
    algo = make_algorithm(
        schedule={"steps": 1}, validation={"every": 1, "n": 3}, checkpoints={"every": 0}
    )
    trainer = vl.Trainer(algo, n_runners=1, inline=True, run_dir=tmp_path, name="v", progress=False)
    result = trainer.fit(two_turn_agent, ROWS, val_dataset=ROWS[:2])
    assert result.by_mode["val"].rollouts == 2 * 2 * 3  # before and after the step
    rollouts, _ = stored(tmp_path / "v" / "store.sqlite")
    val = [r for r in rollouts if r.mode == "val"]
    letters = sorted(r.task.input["letter"] for r in val)
    assert letters == sorted("ab" * 6)
    logged = [m for m in algo.history if "val/rollouts" in m]
    assert [m["val/rollouts"] for m in logged] == [6, 6]
    with pytest.raises(
        ValueError, match=r"validation\.n: Input should be greater than or equal to 1"
    ):
        make_algorithm(validation={"n": 0})


async def test_an_untrained_roles_llm_from_the_trainer_reaches_every_localrl_version(
    tmp_path: Path,
):
    """``Trainer(resources={"user_llm": ...})`` with LocalRL: each version LocalRL publishes
    (after setup, each update, validation) keeps the user's LLM; its calls are recorded
    through the run's gateway and, filtered out, never trained on."""
    from fake_openai_backend import FakeBackend

    async with FakeBackend() as fb:
        algo = make_algorithm(
            schedule={"steps": 2},
            validation={"every": 1},
            trajectory=TrajectoryConfig(agent_filter="assistant"),
        )
        trainer = vl.Trainer(
            algo,
            n_runners=1,
            inline=True,
            run_dir=tmp_path,
            name="roles",
            progress=False,
            resources={"user_llm": vl.LLM(endpoint=fb.url, model="fake-model")},
        )
        result = await trainer.fit_async(assistant_and_user, ROWS, ROWS[:1])
        assert result.stats.failed == 0
        assert len(fb.requests) == len(result.rollouts)  # one user call per rollout
    rollouts, calls = await stored_async(tmp_path / "roles" / "store.sqlite")
    names = [c.agent_name for cs in calls.values() for c in cs]
    assert names.count("user") == names.count("assistant") == len(rollouts)
    steps = [m for m in result.metrics if "update/loss" in m]
    assert [m["batch/rows"] for m in steps] == [4, 4]  # the assistant's calls only
    assert [m["batch/dropped/agent_filter"] for m in steps] == [4, 4]


def test_a_trainer_resource_named_like_the_algorithms_is_refused(tmp_path: Path):
    llm = vl.LLM(endpoint="http://127.0.0.1:1/v1", model="m")
    with pytest.raises(vl.VoltRLError, match=r"resources=\['main_llm'\]: LocalRL publishes"):
        vl.Trainer(make_algorithm(schedule={"steps": 1}), resources={"main_llm": llm})


async def test_every_version_published_keeps_the_trainers_resources_and_a_clash_is_refused(
    tmp_path: Path,
):
    """The one mechanism behind the above, for any algorithm (VERL's driver publishes
    through it too): ``TrainContext.publish`` adds the trainer's resources to each version."""
    from voltrl.observability.metrics import MetricsLog
    from voltrl.runtime.context import TrainContext
    from voltrl.store.memory import InMemoryStore
    from voltrl.types import Run

    store = InMemoryStore()
    user = vl.LLM(endpoint="http://127.0.0.1:1/v1", model="hosted")
    ctx = TrainContext(
        store=store,
        run=Run(name="r", kind="fit"),
        run_dir=tmp_path,
        metrics=MetricsLog(tmp_path / "m.jsonl"),
        max_attempts=1,
        rollout_timeout_s=None,
        trainer_resources={"user_llm": user},
    )
    for version in range(2):
        main = vl.LLM(endpoint=f"http://127.0.0.1:{version + 2}/v1", model="trained")
        saved = await ctx.publish({"main_llm": main})
        assert set(saved.items) == {"main_llm", "user_llm"}
        assert saved.items["main_llm"].endpoint == main.endpoint
        assert saved.items["user_llm"].model == "hosted"
    assert (await store.get_resources()).version == ctx.resources_version
    with pytest.raises(vl.VoltRLError, match=r"publishes \['user_llm'\]"):
        await ctx.publish({"user_llm": user})
