"""APO end to end through ``Trainer.fit``: an agent whose reward depends on the prompt it is
given, an agent LLM and an optimizer LLM that are real HTTP servers (scripted), the run's
gateways and store. The selection is tested with rewrites that do and do not score better."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import yaml
from fake_openai_backend import FakeBackend
from helpers import voltrl

import voltrl as vl
from voltrl._http.serving import serve_in_thread
from voltrl.algorithms.apo import best_template
from voltrl.algorithms.apo.templates import extract, refusal, variables, with_placeholders
from voltrl.cli.train import build_from_config
from voltrl.observability.dashboard import Catalog, dashboard_app
from voltrl.observability.prompt_search import load
from voltrl.runtime.run_dir import algorithm_config
from voltrl.store.sql import SQLStore

START = "Q: {q}"
RETRY_TWICE = {"retries": 2, "backoff_s": 0.01, "max_backoff_s": 0.01}
GOOD = "Q: {q}\nReply with the number only."
ROWS = [{"q": f"{a} + {b}", "answer": a + b} for a, b in [(2, 3), (7, 5), (10, 4), (6, 6)]]


@vl.rollout
async def adder(task: dict[str, Any], resources: vl.Resources) -> float:
    """Renders its prompt template, asks the LLM, and is right when the reply is the number."""
    llm, template = resources["main_llm"], resources["prompt_template"]
    assert isinstance(llm, vl.LLM) and isinstance(template, vl.PromptTemplate)
    body = {"model": llm.model, "messages": [{"role": "user", "content": template.format(**task)}]}
    headers = {"Authorization": f"Bearer {llm.api_key}"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{llm.endpoint}/chat/completions", json=body, headers=headers) as resp,
    ):
        reply = (await resp.json())["choices"][0]["message"]["content"]
    return float(reply.strip() == str(task["answer"]))


def agent_model(req: dict[str, Any]) -> dict[str, str]:
    """The agent's LLM: terse only when the prompt asks for the number alone."""
    prompt = req["messages"][-1]["content"]
    a, b = (int(x) for x in re.search(r"(\d+) \+ (\d+)", prompt).groups())  # type: ignore[union-attr]
    return {"text": str(a + b) if "number only" in prompt else f"The sum is {a + b}."}


def optimizer_model(*rewrites: str) -> Any:
    """The optimizer LLM: a critique, then the given rewrites in turn (each in tags)."""
    left = list(rewrites)

    def answer(req: dict[str, Any]) -> dict[str, str]:
        prompt = req["messages"][-1]["content"]
        if "Do not write a new template yet" in prompt:
            return {"text": "The agent writes a sentence; the reward wants the number alone."}
        return {"text": f"Here it is:\n<prompt>\n{left.pop(0) if left else START}\n</prompt>"}

    return answer


async def fit(
    tmp_path: Path, optimizer: FakeBackend, trainer: dict[str, Any] | None = None, **options: Any
) -> vl.RunResult:
    """``Trainer.fit`` of :func:`adder` with APO (``options``) in ``tmp_path/apo``, its
    runners inline unless ``trainer`` says otherwise (``tests_ray/``: on Ray)."""
    async with FakeBackend() as agent_llm:
        agent_llm.script = agent_model
        algo = vl.APO(
            START,
            optimizer_llm=vl.LLM(endpoint=optimizer.url, model="opt", api_key="sk-opt-secret"),
            rounds=options.pop("rounds", 1),
            beam_width=options.pop("beam_width", 1),
            branch_factor=options.pop("branch_factor", 1),
            train_batch_size=2,
            **options,
        )
        return await vl.Trainer(
            algo,
            resources={"main_llm": vl.LLM(endpoint=agent_llm.url, model="agent-model")},
            run_dir=tmp_path,
            name="apo",
            progress=False,
            **{"inline": True, **(trainer or {})},
        ).fit_async(adder, ROWS, ROWS)


async def optimizer_rollouts(tmp_path: Path) -> list[tuple[vl.Rollout, list[vl.LLMCall]]]:
    store = SQLStore(tmp_path / "apo" / "store.sqlite")
    try:
        found = await store.query_rollouts(mode="optimizer")
        return [(r, await store.get_llm_calls(r.rollout_id)) for r in found]
    finally:
        await store.close()


async def test_a_rewrite_that_scores_better_wins_and_is_the_latest_resources_version(
    tmp_path: Path,
) -> None:
    async with FakeBackend() as optimizer:
        optimizer.script = optimizer_model(GOOD)
        result = await fit(tmp_path, optimizer)

    run_dir = tmp_path / "apo"
    search = load(run_dir)
    assert search is not None and search.best is not None
    assert (search.start.score, search.best.template, search.best.score) == (0.0, GOOD, 1.0)
    assert search.best.parent == search.start.version and search.best.round == 1
    assert search.best.critique and "number alone" in search.best.critique
    final = json.loads((run_dir / "final" / "prompt_template.json").read_text())
    assert (final["template"], final["score"], final["start_score"]) == (GOOD, 1.0, 0.0)
    assert best_template(result.run_dir) == vl.PromptTemplate(template=GOOD)
    store = SQLStore(run_dir / "store.sqlite")
    latest = await store.get_resources()
    await store.close()
    assert latest is not None and latest["prompt_template"].template == GOOD  # type: ignore[union-attr]
    # the good template's validation rollouts ran with the version that holds it
    val = [
        r for r in result.rollouts if r.mode == "val" and r.resources_version == search.best.version
    ]
    assert len(val) == len(ROWS) and all(r.reward == 1.0 for r in val)
    rounds = [m for m in result.metrics if m.get("apo/best_score") is not None]
    assert [m["apo/best_score"] for m in rounds] == [0.0, 1.0]
    # the optimizer's calls: recorded in a rollout of its own, under its agent name
    [(rollout, calls)] = await optimizer_rollouts(tmp_path)
    assert rollout.status == "succeeded" and rollout.run_id == result.run.run_id
    assert [c.agent_name for c in calls] == ["apo-optimizer"] * 2
    assert "--- run 1 (reward 0.0) ---" in calls[0].request["messages"][0]["content"]
    assert "sk-opt-secret" not in (run_dir / "store.sqlite").read_bytes().decode("latin-1")
    assert {r["authorization"] for r in optimizer.requests} == {"Bearer sk-opt-secret"}


async def test_a_rewrite_that_scores_no_better_loses_and_the_start_stays_best(
    tmp_path: Path,
) -> None:
    async with FakeBackend() as optimizer:
        optimizer.script = optimizer_model("Question: Q: {q}", "Q: {q}\nThink hard.")
        await fit(tmp_path, optimizer, rounds=3, branch_factor=2, patience=1)

    search = load(tmp_path / "apo")
    assert search is not None and search.best is search.start
    assert search.rounds_done == 1 and search.stopped == "no better template for 1 round(s)"
    assert [(c.round, c.status, c.score) for c in search.candidates] == [
        (0, "kept", 0.0),
        (1, "dropped", 0.0),
        (1, "dropped", 0.0),
    ]
    final = json.loads((tmp_path / "apo" / "final" / "prompt_template.json").read_text())
    assert final["template"] == START


async def test_a_rewrite_that_would_break_the_agent_is_refused_before_it_runs(
    tmp_path: Path,
) -> None:
    async with FakeBackend() as optimizer:
        optimizer.script = optimizer_model("Reply with the number only.", "Q: {q} {hint}", GOOD)
        result = await fit(tmp_path, optimizer, branch_factor=3, repair=False)

    search = load(tmp_path / "apo")
    assert search is not None
    refused = [(c.status, c.reason, c.version) for c in search.candidates if c.status == "rejected"]
    assert set(refused) == {
        ("rejected", "drops the template variable(s) q", None),
        ("rejected", "adds the variable(s) hint, which the agent does not fill in", None),
    }
    assert search.best is not None and search.best.template == GOOD
    assert [m["apo/rejected"] for m in result.metrics if "apo/rejected" in m] == [0, 2]
    assert not [r for r in result.rollouts if r.status == "failed"]


async def test_a_rewrite_that_drops_the_input_placeholder_gets_it_appended_and_runs(
    tmp_path: Path,
) -> None:
    async with FakeBackend() as optimizer:
        optimizer.script = optimizer_model("Reply with the number only.")
        result = await fit(tmp_path, optimizer)

    search = load(tmp_path / "apo")
    assert search is not None and search.best is not None
    assert search.best.template == "Reply with the number only.\n\nQ: {q}"
    assert search.best.repaired == "appended 'Q: {q}' from the start, which the rewrite left out"
    assert (search.best.status, search.best.score) == ("kept", 1.0)
    with (
        serve_in_thread(dashboard_app(Catalog([tmp_path]))) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        page = client.get(f"/runs/{result.run.run_id}").text
    assert "repaired: appended &#39;Q: {q}&#39; from the start, which the rewrite left out" in page
    shown = voltrl("show", "apo", "--run-dir", str(tmp_path), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    # the note is outside the folded template: it shows however long the template is
    assert "repaired: appended 'Q: {q}' from the start" in re.sub(r"\s*│\s*", " ", shown.stdout)


async def test_with_an_answer_key_the_critique_induces_the_instruction_from_input_output_pairs(
    tmp_path: Path,
) -> None:
    async with FakeBackend() as optimizer:
        optimizer.script = optimizer_model(GOOD)
        await fit(tmp_path, optimizer, answer_key="answer")

    [(_, calls)] = await optimizer_rollouts(tmp_path)
    critique = calls[0].request["messages"][0]["content"]
    assert critique.startswith("I gave a friend an instruction") and critique.endswith(
        "The instruction was"
    )
    pairs = re.findall(r"Input: (\d+) \+ (\d+)\nOutput: (\d+)", critique)
    assert len(pairs) == 2 and all(int(a) + int(b) == int(c) for a, b, c in pairs)
    assert "assistant:" not in critique  # pairs, not transcripts


async def test_an_answer_key_the_tasks_lack_stops_the_run_naming_it(tmp_path: Path) -> None:
    async with FakeBackend() as optimizer:
        optimizer.script = optimizer_model(GOOD)
        with pytest.raises(
            vl.VoltRLError, match=r"answer_key 'label' is not a field of 4 training task\(s\): "
        ):
            await fit(tmp_path, optimizer, answer_key="label")


async def test_a_critique_of_runs_that_all_tied_says_so_and_shows_each_task(
    tmp_path: Path,
) -> None:
    async with FakeBackend() as optimizer:
        optimizer.script = optimizer_model(GOOD)
        await fit(tmp_path, optimizer)

    [(_, calls)] = await optimizer_rollouts(tmp_path)
    critique = calls[0].request["messages"][0]["content"]
    assert "Every one of these runs got the same reward (0.0)" in critique
    assert len(re.findall(r'task: \{"q": "\d+ \+ \d+", "answer": \d+\}\nuser: Q: ', critique)) == 2


async def test_without_show_task_the_critique_quotes_only_what_the_agent_saw(
    tmp_path: Path,
) -> None:
    async with FakeBackend() as optimizer:
        optimizer.script = optimizer_model(GOOD)
        await fit(tmp_path, optimizer, show_task=False)

    [(_, calls)] = await optimizer_rollouts(tmp_path)
    critique = calls[0].request["messages"][0]["content"]
    assert "task: " not in critique
    assert "user: Q: " in critique


async def test_an_optimizer_that_keeps_failing_is_retried_then_stops_the_run_saying_why(
    tmp_path: Path,
) -> None:
    async with FakeBackend() as optimizer:
        optimizer.fail_next(*[503] * 20, message="model overloaded")
        with pytest.raises(vl.VoltRLError, match="every call to the optimizer LLM failed"):
            await fit(tmp_path, optimizer, {"gateway_retry": RETRY_TWICE}, rounds=2)
        assert len(optimizer.requests) == 3  # the gateway's retries (2 here), then reported

    [(rollout, _)] = await optimizer_rollouts(tmp_path)
    assert rollout.status == "failed" and "model overloaded" in (rollout.error or "")
    search = load(tmp_path / "apo")
    assert search is not None and (search.stopped or "").startswith(
        "failed: APO round 1: every call to the optimizer LLM failed"
    )
    assert [c.status for c in search.candidates] == ["kept", "failed"]


@pytest.mark.parametrize(
    ("candidate", "reason"),
    [
        ("Q: {q}", "the same as a template already tried"),
        ("Q: {q", "broken template syntax"),
        ("Q: {}", "broken template syntax"),
        ("   ", "empty template"),
        ("Q: {q!z}", "uses the field {q!z}"),
        ("Q: {q.__class__}", "uses the field {q.__class__}"),
        ("Q: {q[0]}", "uses the field {q[0]}"),
        ("Q: {q:>>>}", "uses the field {q:>>>}"),
        ("Question {q}, please {{literally}}", None),
    ],
)
def test_refusal_names_what_would_break(candidate: str, reason: str | None) -> None:
    found = refusal(candidate, vl.PromptTemplate(template=START), [START])
    assert (found or "").startswith(reason or "") and (found is None) == (reason is None)


def test_a_repair_appends_the_starts_lines_holding_what_was_left_out_in_the_starts_order() -> None:
    start = vl.PromptTemplate(template="Context: {c}\nScore: {s:.2f}\nQ: {q}")
    assert with_placeholders("Answer the question below.", start) == (
        "Answer the question below.\n\nContext: {c}\nScore: {s:.2f}\nQ: {q}",
        "appended 'Context: {c} / Score: {s:.2f} / Q: {q}' from the start, which the rewrite "
        "left out",
    )
    fixed, note = with_placeholders("Use the context: {c}, then answer.", start)
    assert fixed.endswith("then answer.\n\nScore: {s:.2f}\nQ: {q}") and note
    assert with_placeholders("{q} {c} {s:.2f}", start) == ("{q} {c} {s:.2f}", None)
    assert with_placeholders("Broken { here too", start) == ("Broken { here too", None)
    assert with_placeholders("and", start) == ("and", None)  # a misread answer: refused as is
    jinja = vl.PromptTemplate(
        template="{% for m in msgs %}\n{{ m }}\n{% endfor %}\nQ: {{ q }}", engine="jinja"
    )
    loop_only = "Answer in one word: {{ q }}"  # msgs lives only in the loop: not put back
    assert with_placeholders(loop_only, jinja) == (loop_only, None)
    plain = vl.PromptTemplate(template="Context: {{ c }}\nQ: {{ q }}", engine="jinja")
    fixed, _ = with_placeholders("Answer in one word, please.", plain)
    assert fixed == "Answer in one word, please.\n\nContext: {{ c }}\nQ: {{ q }}"


def test_jinja_templates_are_checked_with_jinja() -> None:
    start = vl.PromptTemplate(template="Q: {{ q }}", engine="jinja")
    assert variables(start.template, "jinja") == {"q"}
    assert refusal("Q: {{ q }", start, []) is not None
    assert refusal("{% if q %}Q: {{ q }}{% endif %}", start, []) is None
    assert refusal("Q: {{ question }}", start, []) == ("drops the template variable(s) q")


def test_the_rewrite_is_read_from_tags_then_a_fenced_block_then_the_whole_answer() -> None:
    assert extract("Sure.\n<prompt>\nA {q}\n</prompt>\nDone") == "A {q}"
    assert extract("<prompt>\n<Prompt>\nA {q} and then it was cut") == "A {q} and then it was cut"
    assert extract("```text\nB {q}\n```") == "B {q}"
    assert extract("  C {q}  ") == "C {q}"


def test_bad_settings_are_refused_when_apo_is_built() -> None:
    opt = vl.LLM(endpoint="http://127.0.0.1:9/v1", model="m")
    with pytest.raises(ValueError, match="beam_width must be at least 1"):
        vl.APO(START, optimizer_llm=opt, beam_width=0)
    with pytest.raises(vl.VoltRLError, match=r"rewrite_prompt must use \{critique\}"):
        vl.APO(START, optimizer_llm=opt, rewrite_prompt="Improve {template}")
    with pytest.raises(ValueError, match="not a VoltRL gateway"):
        vl.APO(START, optimizer_llm=opt.model_copy(update={"gateway": True}))
    with pytest.raises(vl.VoltRLError, match="starting template is not a valid template"):
        vl.APO("Q: {q", optimizer_llm=opt)
    config = vl.APO(START, optimizer_llm=opt.model_copy(update={"api_key": "sk-x"})).config()
    assert "sk-x" not in json.dumps(config) and config["prompt"]["template"] == START


@pytest.mark.slow
async def test_voltrl_show_lists_the_candidates_and_the_diff_to_the_best(tmp_path: Path) -> None:
    async with FakeBackend() as optimizer:
        optimizer.script = optimizer_model(GOOD)
        await fit(tmp_path, optimizer)

    shown = voltrl("show", "apo", "--run-dir", str(tmp_path), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "prompt search (prompt_search.json): 1 round(s), 1 round(s) done" in out
    assert "kept (best)" in out and "Q: {q}" in out
    assert "start → best (v3, round 1)" in out and "+Reply with the number only." in out
    assert re.search(r"│ optimizer +│ +1 │", out), out  # its rollout, counted by mode


async def test_the_dashboards_run_page_shows_each_candidate_and_the_diff(tmp_path: Path) -> None:
    async with FakeBackend() as optimizer:
        optimizer.script = optimizer_model(GOOD, "Q: {q} <i>be brief</i>", "Q: {q} {hint}")
        result = await fit(tmp_path, optimizer, branch_factor=3)

    with (
        serve_in_thread(dashboard_app(Catalog([tmp_path]))) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        page = client.get(f"/runs/{result.run.run_id}").text
    assert "Prompt search" in page and "1 round(s) · 1 round(s) done" in page
    candidates = page.split('id="candidates"', 1)[1].split("</table>", 1)[0]
    assert candidates.count("<tr") == 1 + 4  # the header; start, winner, loser, refused
    assert "&lt;i&gt;be brief&lt;/i&gt;" in page and "<i>be brief" not in page  # escaped
    assert "adds the variable(s) hint" in page
    assert '<span class="add">+Reply with the number only.</span>' in page


async def test_the_runs_train_yaml_builds_the_same_search_again(tmp_path: Path) -> None:
    async with FakeBackend() as optimizer:
        optimizer.script = optimizer_model(GOOD)
        result = await fit(tmp_path, optimizer)

    text = (tmp_path / "apo" / "train.yaml").read_text()
    assert "sk-opt-secret" not in text
    config = yaml.safe_load(text)
    trainer, agent, train, val = build_from_config(config)
    assert algorithm_config(trainer.algorithm) == result.run.config
    assert agent.fn.__name__ == "adder" and Path(train).is_file() and Path(val).is_file()
    config["algorithm"]["rewrite_prompt"] = "Improve {template}"
    with pytest.raises(vl.VoltRLError, match=r"algorithm: APO: rewrite_prompt must use"):
        build_from_config(config)
    del config["algorithm"]["optimizer_llm"]
    with pytest.raises(vl.VoltRLError, match=r"algorithm.optimizer_llm: APO needs it"):
        build_from_config(config)


def test_a_field_the_starting_template_uses_itself_is_allowed() -> None:
    start = vl.PromptTemplate(template="Q: {q!r} in {n:.2f}s")
    assert refusal("Answer {q!r} within {n:.2f} seconds", start, []) is None
    assert refusal("Answer {q} within {n:.3f} seconds", start, []) == (
        "uses the field {n:.3f}: only plain {name} fields or the start's own"
    )


def test_a_failed_rollout_counts_failed_reward_in_a_score() -> None:
    apo = vl.APO(START, optimizer_llm=vl.LLM(endpoint="http://x/v1", model="m"), failed_reward=-1)
    task = vl.Task(input={})
    ok = vl.Rollout(task=task, status="succeeded", reward=1.0)
    unrewarded = vl.Rollout(task=task, status="succeeded", reward=None)
    failed = vl.Rollout(task=task, status="failed")
    assert apo._score_of([ok, unrewarded, failed]) == 0.0


async def test_a_wider_beam_expands_every_member_and_refuses_a_repeat_from_a_sibling(
    tmp_path: Path,
) -> None:
    async with FakeBackend() as optimizer:
        optimizer.script = optimizer_model(*[GOOD] * 10)
        await fit(tmp_path, optimizer, rounds=2, beam_width=2, branch_factor=2, patience=2)

    search = load(tmp_path / "apo")
    assert search is not None and search.best is not None and search.best.template == GOOD
    table = [(c.round, c.status, c.reason) for c in search.candidates]
    repeat = "the same as a template already tried"
    assert table == [
        (0, "kept", None),  # still in the beam of two, behind the winner
        (1, "kept", None),
        (1, "rejected", repeat),  # its sibling wrote it first
        *[(2, "rejected", repeat)] * 4,  # both beam members expanded, twice each
    ]
    assert len(await optimizer_rollouts(tmp_path)) == 1 + 2
