"""``LocalRL(prompt_search=APO(...))``: APO chooses the prompt on the model being trained (our
engine, end to end), then LocalRL trains the weights with it, in one run; resume in either
phase; the config, ``train.yaml`` and the dashboard. The optimizer is a scripted server where
its wit is not the point, the trained model itself where it is."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fake_openai_backend import FakeBackend
from local_rl_setup import make_algorithm
from openai import AsyncOpenAI

import voltrl as vl
from voltrl._http.serving import serve_in_thread
from voltrl.cli.train import build_from_config
from voltrl.observability.dashboard import Catalog, dashboard_app
from voltrl.observability.prompt_search import load
from voltrl.runtime.run_dir import algorithm_config
from voltrl.store.sql import SQLStore

START = "Say {letter}."
GOOD = "Say {letter}. Reply with the letter only."
ROWS = [{"letter": c} for c in "abcd"]
RETRY_ONCE = {"retries": 1, "backoff_s": 0.01, "max_backoff_s": 0.01}


@vl.rollout
async def say(task: dict[str, Any], resources: vl.Resources) -> float:
    """Renders its template and asks the model (the tiny one says nothing sensible): the
    reward is the template's, 1.0 for the one asking for the letter alone."""
    llm, template = resources["main_llm"], resources["prompt_template"]
    assert isinstance(llm, vl.LLM) and isinstance(template, vl.PromptTemplate)
    prompt = template.format(**task)
    async with AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0) as client:
        await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": prompt}],
            **llm.sampling_parameters,
        )
    return 1.0 if "letter only" in prompt else 0.0


def optimizer_model(req: dict[str, Any]) -> dict[str, str]:
    """The optimizer: a critique, then the good template."""
    if "Do not write a new template yet" in req["messages"][-1]["content"]:
        return {"text": "The agent is not told to answer with the letter alone."}
    return {"text": f"<prompt>\n{GOOD}\n</prompt>"}


def algorithm(optimizer: FakeBackend | None, **overrides: Any) -> vl.LocalRL:
    """A tiny LocalRL (1 step of 2 tasks x 2, validating at the end) after a 1-round APO."""
    apo = vl.APO(
        START,
        optimizer_llm=None if optimizer is None else vl.LLM(endpoint=optimizer.url, model="opt"),
        rounds=1,
        beam_width=1,
        branch_factor=1,
        train_batch_size=2,
        optimizer_sampling={"temperature": 1.0, "max_tokens": 8},
    )
    settings: dict[str, Any] = {"schedule": {"steps": 1}, "validation": {"every": 1}}
    return make_algorithm(prompt_search=apo, **{**settings, **overrides})


def fit(tmp_path: Path, algo: vl.LocalRL, **trainer: Any) -> vl.RunResult:
    return vl.Trainer(
        algo,
        n_runners=1,
        inline=True,
        run_dir=tmp_path,
        name="both",
        progress=False,
        **trainer,
    ).fit(say, ROWS, val_dataset=ROWS[:2])


async def versions_of(path: Path) -> tuple[list[vl.Rollout], dict[int, vl.Resources]]:
    """The run's rollouts, and the resources version each ran with."""
    store = SQLStore(path)
    try:
        rollouts = await store.query_rollouts()
        held = {
            v: await store.get_resources(v)
            for v in {r.resources_version for r in rollouts if r.resources_version is not None}
        }
        return rollouts, held  # type: ignore[return-value]
    finally:
        await store.close()


def templates_of_steps(run_dir: Path, result: vl.RunResult) -> dict[int, str]:
    """Each LocalRL step's template: the one its rollouts' resources version held."""
    _, held = asyncio.run(versions_of(run_dir / "store.sqlite"))
    return {
        m["step"]: held[m["resources_version"]]["prompt_template"].template  # type: ignore[union-attr]
        for m in result.metrics
        if "update/loss" in m
    }


def apo_rounds(run_dir: Path) -> list[int]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["step"] for x in lines if "apo/best_score" in x]


@pytest.mark.slow
def test_apo_chooses_the_prompt_on_the_engine_then_local_rl_trains_with_it(tmp_path: Path):
    async def scripted() -> vl.RunResult:
        async with FakeBackend() as optimizer:
            optimizer.script = optimizer_model
            return await asyncio.to_thread(fit, tmp_path, algorithm(optimizer))

    result = asyncio.run(scripted())
    run_dir = tmp_path / "both"
    search = load(run_dir)
    assert search is not None and search.finished and search.best is not None
    assert (search.start.score, search.best.template, search.best.score) == (0.0, GOOD, 1.0)
    # every version carries both; APO's ran on the engine greedily, LocalRL's step with its
    # own sampling and the chosen template
    rollouts, held = asyncio.run(versions_of(run_dir / "store.sqlite"))
    assert all({"main_llm", "prompt_template"} <= set(held[v].items) for v in held)
    assert all(held[v]["main_llm"].model == "voltrl-local" for v in held)  # type: ignore[union-attr]
    assert templates_of_steps(run_dir, result) == {1: GOOD}
    step = next(m for m in result.metrics if "update/loss" in m)
    assert held[step["resources_version"]]["main_llm"].sampling_parameters["temperature"] == 1.0  # type: ignore[union-attr]
    apo_versions = {c.version for c in search.candidates}
    apo_llms = [
        held[r.resources_version]["main_llm"]
        for r in rollouts
        if r.resources_version in apo_versions
    ]  # type: ignore[index]
    assert apo_llms and {llm.sampling_parameters["temperature"] for llm in apo_llms} == {0.0}  # type: ignore[union-attr]
    # LocalRL's validations (before and after the step) both see the chosen template
    val = [m for m in result.metrics if "val/reward_mean" in m]
    assert [(m["step"], m["val/reward_mean"]) for m in val] == [(0, 1.0), (1, 1.0)]
    assert [m["step"] for m in result.metrics if "apo/val_reward_mean" in m] == [0, 1]
    assert (run_dir / "final" / "config.json").exists()
    assert (run_dir / "final" / "prompt_template.json").exists()

    # one run page: the search's table and the RL charts
    with (
        serve_in_thread(dashboard_app(Catalog([tmp_path]))) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        page = client.get(f"/runs/{result.run.run_id}").text
    assert "Prompt search" in page and "1 round(s) · 1 round(s) done" in page
    series = json.loads(page.split('id="series">', 1)[1].split("</script>", 1)[0])
    names = {name for name, _, _ in series["series"]}
    assert {"update/loss", "val/reward_mean", "apo/best_score", "apo/val_reward_mean"} <= names

    # train.yaml records both phases and builds the same run again
    config = yaml.safe_load((run_dir / "train.yaml").read_text())
    assert config["algorithm"]["prompt_search"]["prompt"]["template"] == START
    config["algorithm"]["model"] = "tiny"
    trainer, _, _, _ = build_from_config(config)
    rebuilt = algorithm_config(trainer.algorithm)
    assert rebuilt["prompt_search"] == result.run.config["prompt_search"]


@pytest.mark.slow
def test_a_run_stopped_in_the_search_searches_again_and_one_stopped_after_does_not(
    tmp_path: Path,
):
    async def scripted() -> tuple[vl.RunResult, vl.RunResult]:
        async with FakeBackend() as optimizer:
            optimizer.fail_next(503, 503, message="model overloaded")  # a try, a retry
            with pytest.raises(vl.VoltRLError, match="every call to the optimizer LLM failed"):
                await asyncio.to_thread(
                    fit, tmp_path, algorithm(optimizer), gateway_retry=RETRY_ONCE
                )
            search = load(tmp_path / "both")
            assert search is not None and not search.finished
            assert not (tmp_path / "both" / "checkpoints").exists()  # no weights trained

            optimizer.script = optimizer_model
            resumed = algorithm(optimizer, checkpoints={"every": 1, "resume": True})
            first = await asyncio.to_thread(fit, tmp_path, resumed)
            asked = len(optimizer.requests)
            more = algorithm(optimizer, schedule={"steps": 2}, checkpoints={"resume": True})
            second = await asyncio.to_thread(fit, tmp_path, more)
            assert len(optimizer.requests) == asked  # no search this time
            return first, second

    first, second = asyncio.run(scripted())
    assert templates_of_steps(tmp_path / "both", first) == {1: GOOD}
    assert templates_of_steps(tmp_path / "both", second) == {2: GOOD}
    assert [m["step"] for m in second.metrics if "update/loss" in m] == [2]
    assert apo_rounds(tmp_path / "both") == [0, 0, 1]  # the failed session's round 0, then both
    search = load(tmp_path / "both")
    assert search is not None and search.finished and search.best is not None
    assert search.best.template == GOOD


@pytest.mark.slow
def test_without_an_optimizer_llm_the_model_being_trained_writes_the_rewrites(tmp_path: Path):
    result = fit(tmp_path, algorithm(None))
    store = SQLStore(tmp_path / "both" / "store.sqlite")

    async def optimizer_calls() -> list[vl.LLMCall]:
        try:
            [rollout] = await store.query_rollouts(mode="optimizer")
            return await store.get_llm_calls(rollout.rollout_id)
        finally:
            await store.close()

    calls = asyncio.run(optimizer_calls())
    assert [c.agent_name for c in calls] == ["apo-optimizer"] * 2  # a critique, a rewrite
    assert {c.model for c in calls} == {"voltrl-local"}
    assert [m["step"] for m in result.metrics if "update/loss" in m] == [1]


def test_what_cannot_run_is_refused_when_built(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"prompt_search must be an APO\(...\), not str"):
        make_algorithm(prompt_search="Say {letter}.")
    with pytest.raises(ValueError, match="that name is LocalRL's LLM"):
        make_algorithm(prompt_search=vl.APO(START, resource="main_llm"))
    algo = make_algorithm(prompt_search=vl.APO(START, resource="instructions"))
    assert algo.publishes == ("main_llm", "instructions")
    with pytest.raises(vl.VoltRLError, match="only as LocalRL"):
        vl.Trainer(vl.APO(START), run_dir=tmp_path, progress=False, inline=True).fit(say, ROWS)


def test_voltrl_train_builds_the_prompt_search_from_yaml(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config: dict[str, Any] = {
        "agent": f"{__file__}:say",
        "data": {"train": str(data)},
        "algorithm": {
            "name": "local_rl",
            "model": "tiny",
            "prompt_search": {"prompt": START, "rounds": 2},
        },
    }
    trainer, _, _, _ = build_from_config(config)
    apo = trainer.algorithm.prompt_search
    assert isinstance(apo, vl.APO) and apo.optimizer_llm is None and apo.rounds == 2
    config["algorithm"]["prompt_search"] = {"prompt": START, "optimizer_llm": {"model": "x"}}
    with pytest.raises(vl.VoltRLError, match=r"algorithm.prompt_search.optimizer_llm.endpoint"):
        build_from_config(config)
    config["algorithm"]["prompt_search"] = {"prompt": START, "beam": 2}
    with pytest.raises(vl.VoltRLError, match=r"algorithm.prompt_search.beam: unknown field"):
        build_from_config(config)
    config["algorithm"]["prompt_search"] = {"rounds": 2}
    with pytest.raises(vl.VoltRLError, match=r"algorithm.prompt_search.prompt: APO needs it"):
        build_from_config(config)
