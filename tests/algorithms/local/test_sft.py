"""vl.SFT: warm-start from recorded rollouts, alone and before LocalRL, on the same trajectory
builder and batch as RL.

A teacher run is recorded for real: a scripted teacher server (``samples/teacher_server.py``,
the hosted-API shape: no token ids) or the fake vLLM backend (token ids), a tool-calling agent on
the OpenAI client, the trainer's gateway and SQLite store.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest
from fake_openai_backend import FakeBackend, tool_then_answer
from helpers import voltrl_here
from openai import AsyncOpenAI
from sft_agents import (
    ADDING_AGENT,
    TASKS,
    TOOLS,
    adding_agent,
    record_teacher_run,
    teacher_module,
    tiny_model_dir,
)

import voltrl as vl
from voltrl.algorithms.local.conversations import chat_retokenizer
from voltrl.algorithms.local.shared_prefix import split_common_prefix
from voltrl.errors import VoltRLError
from voltrl.models.chat import render_chat
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.store.sql import SQLStore


def test_the_retokenizer_renders_a_call_as_the_engine_would_prompt_and_answer_it(tmp_path):
    run_dir = record_teacher_run(tmp_path)
    tok = build_tiny_tokenizer()
    calls = asyncio.run(_calls(run_dir))
    assert calls and all(c.prompt_token_ids is None for c in calls)  # hosted-API shape
    retokenize = chat_retokenizer(tok)
    for call in calls:
        prompt, response = retokenize(call)
        messages, tools = call.request["messages"], call.request["tools"]
        assert prompt == tok.encode(render_chat(tok, messages, tools), add_special_tokens=False)
        text = tok.decode(response)
        message = call.response["choices"][0]["message"]
        if message.get("tool_calls"):  # the student's own tool-call format, not the API's
            a, b = messages[0]["content"].split()[-2:]
            assert tok.decode(prompt) == (
                "<|im_start|>system\n<tools>add(a, b)</tools><|im_end|>\n"
                f"<|im_start|>user\nAdd {a} {b}<|im_end|>\n<|im_start|>assistant\n"
            )
            assert text == (
                f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n'
                "</tool_call><|im_end|>"
            )
        else:
            assert text == f"{message['content']}<|im_end|>"


def test_a_written_conversation_trains_exactly_the_assistants_turns():
    """``tokenize_conversation``: the mask is 1 on each assistant turn's tokens through its
    end-of-turn token and 0 on the system, user and tool turns and on what the template adds."""
    from voltrl.algorithms.local.conversations import tokenize_conversation

    tok = build_tiny_tokenizer()
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Add 2 3"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ]
    ids, mask = tokenize_conversation(tok, {"messages": messages, "tools": TOOLS})
    text = render_chat(tok, messages, TOOLS, add_generation_prompt=False)
    assert ids == tok.encode(text, add_special_tokens=False)
    trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == (
        '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call><|im_end|>It is 5.<|im_end|>'
    )


async def _calls(run_dir: Path) -> list[Any]:
    store = SQLStore(run_dir / "store.sqlite")
    try:
        out = []
        for rollout in await store.query_rollouts():
            out += await store.get_llm_calls(rollout.rollout_id)
        return out
    finally:
        await store.close()


def test_sft_refuses_calls_without_token_ids_unless_told_to_retokenize(tmp_path):
    run_dir = record_teacher_run(tmp_path)
    sft = vl.SFT("tiny", source=run_dir)
    with pytest.raises(VoltRLError, match=r"without token ids.*retokenize=True"):
        asyncio.run(sft.build_batch(build_tiny_tokenizer()))


def test_sft_rows_are_the_rewarded_rollouts_retokenized_and_merged_into_one_row_each(tmp_path):
    run_dir = record_teacher_run(tmp_path)
    tok = build_tiny_tokenizer()
    everything = asyncio.run(vl.SFT("tiny", source=run_dir, retokenize=True).build_batch(tok))
    good = asyncio.run(
        vl.SFT("tiny", source=run_dir, retokenize=True, min_reward=1.0).build_batch(tok)
    )
    assert everything.stats["rollouts_with_rows"] == len(TASKS)
    assert 0 < good.stats["rollouts_with_rows"] < len(TASKS)  # the teacher errs on some
    assert good.stats.get("merge_failures", 0) == 0 and good.stats["merged"] == len(good)
    assert len(good) == good.stats["rollouts_with_rows"]
    assert good.stats["retokenized"] == 2 * len(good)  # a tool call and an answer each
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for ids, mask in zip(good.response_ids, good.response_mask, strict=True):
        trained = [t for t, m in zip(ids, mask, strict=True) if m]
        text = tok.decode(trained)
        assert text.startswith("<tool_call>") and "The sum is" in text
        assert trained.count(end) == 2  # each turn's end, never the tool result in between
        assert "<tool_response>" in tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])


def test_sft_trains_exactly_the_teachers_recorded_token_ids_when_it_returned_them(tmp_path):
    async def go() -> tuple[Any, list[Any]]:
        async with FakeBackend() as fb:
            fb.script = tool_then_answer('{"a": 1, "b": 2}', "The sum is 3.", tool="add")
            trainer = vl.Trainer(
                resources={"main_llm": vl.LLM(endpoint=fb.url, model="fake-model")},
                run_dir=tmp_path / "runs",
                name="teacher",
                n_runners=1,
                inline=True,
                progress=False,
            )
            result = await trainer.dev_async(adding_agent, TASKS[:2])
        sft = vl.SFT("tiny", source=result.run_dir, trajectory={"mode": "transition"})
        batch = await sft.build_batch(build_tiny_tokenizer())
        return batch, await _calls(Path(result.run_dir))

    batch, calls = asyncio.run(go())
    recorded = sorted(tuple(c.response_token_ids) for c in calls)
    trained = sorted(
        tuple(t for t, m in zip(ids, mask, strict=True) if m)
        for ids, mask in zip(batch.response_ids, batch.response_mask, strict=True)
    )
    assert trained == recorded and "retokenized" not in batch.stats


def test_sft_with_an_agent_filter_trains_only_that_agents_calls(tmp_path):
    @vl.rollout
    async def three_agents(task: dict, llm: vl.LLM) -> float:
        for agent in ("planner", "solver", "critic"):
            client = AsyncOpenAI(
                base_url=llm.endpoint,
                api_key=llm.api_key,
                max_retries=0,
                default_headers={"x-agent-name": agent},
            )
            await client.chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": f"{agent} {task['a']}"}]
            )
        return 1.0

    def policy(request: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        return {"content": "I am " + request["messages"][0]["content"].split()[0]}

    with teacher_module().serve_teacher(policy) as url:
        result = vl.Trainer(
            resources={"main_llm": vl.LLM(endpoint=url, model="teacher")},
            request_token_ids=False,
            run_dir=tmp_path / "runs",
            name="three",
            n_runners=1,
            inline=True,
            progress=False,
        ).dev(three_agents, TASKS[:3])
    tok = build_tiny_tokenizer()
    batch = asyncio.run(
        vl.SFT("tiny", source=result.run_dir, retokenize=True, agents="solver").build_batch(tok)
    )
    assert batch.agent_names == ["solver"] * 3
    assert batch.stats["dropped/agent_filter"] == 6
    for ids, mask in zip(batch.response_ids, batch.response_mask, strict=True):
        assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]).startswith(
            "I am solver"
        )


def test_sft_selects_runs_by_name_across_sources_and_says_which_runs_exist(tmp_path):
    first = record_teacher_run(tmp_path, "teacher")
    second = record_teacher_run(tmp_path, "other")
    tok = build_tiny_tokenizer()
    both = vl.SFT("tiny", source=[first, second], retokenize=True)
    assert asyncio.run(both.build_batch(tok)).stats["rollouts_with_rows"] == 2 * len(TASKS)
    other = vl.SFT("tiny", source=[first, second], retokenize=True, runs=["other"])
    batch = asyncio.run(other.build_batch(tok))
    assert batch.stats["rollouts_with_rows"] == len(TASKS)
    assert set(batch.rollout_ids) == {r.rollout_id for r in asyncio.run(_rollouts(second))}
    with pytest.raises(VoltRLError, match=r"no run \['nope'\].*runs there: other, teacher"):
        asyncio.run(vl.SFT("tiny", source=[first, second], runs="nope").build_batch(tok))
    with pytest.raises(VoltRLError, match="nothing to train on"):
        asyncio.run(vl.SFT("tiny", source=first, retokenize=True, min_reward=2).build_batch(tok))
    missing = vl.SFT("tiny", source=tmp_path / "missing")
    with pytest.raises(VoltRLError, match="does not exist"):
        asyncio.run(missing.build_batch(tok))


async def _rollouts(run_dir: Path) -> list[Any]:
    store = SQLStore(run_dir / "store.sqlite")
    try:
        return await store.query_rollouts()
    finally:
        await store.close()


def test_the_sft_loss_is_the_mean_nll_of_the_masked_tokens_however_micro_batched(tmp_path):
    import torch

    run_dir = record_teacher_run(tmp_path)
    tok = build_tiny_tokenizer()
    batch = asyncio.run(vl.SFT("tiny", source=run_dir, retokenize=True).build_batch(tok))
    nll, tokens = 0.0, 0
    model = build_tiny_model(tok, seed=3)
    with torch.no_grad():
        for p, pm, r, rm in zip(
            batch.prompt_ids,
            batch.prompt_mask,
            batch.response_ids,
            batch.response_mask,
            strict=True,
        ):
            prompt = [t for t, m in zip(p, pm, strict=True) if m]
            response = r[: len(rm) - rm[::-1].index(1)]
            labels = [-100] * len(prompt) + [
                t if m else -100 for t, m in zip(response, rm, strict=False)
            ]
            n = sum(1 for x in labels if x != -100)
            out = model(input_ids=torch.tensor([prompt + response]), labels=torch.tensor([labels]))
            nll, tokens = nll + out.loss.item() * n, tokens + n
    t = batch.to_torch()
    lengths = t["prompt_mask"].sum(1).tolist()
    inputs = t["input_ids"], t["attention_mask"], t["position_ids"]
    shared = split_common_prefix(build_tiny_model(tok), *inputs, lengths)
    assert shared[0] is not None  # rows fed together feed their system prompt once; alone not
    for micro in (None, 1):
        sft = vl.SFT(
            "tiny", source=run_dir, steps=1, lr=0.0, batch_size=len(batch), micro_batch_size=micro
        )
        [loss] = sft.fit_batch(build_tiny_model(tok, seed=3), batch)
        assert loss == pytest.approx(nll / tokens, rel=1e-4)


@pytest.mark.slow
def test_sft_alone_lowers_the_loss_and_saves_a_model_that_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir = record_teacher_run(tmp_path)
    sft = vl.SFT(
        tiny_model_dir(tmp_path), source=run_dir, retokenize=True, steps=40, lr=3e-3, batch_size=4
    )
    result = vl.Trainer(sft, run_dir=tmp_path / "runs", name="sft", progress=False).fit(
        adding_agent, TASKS
    )
    assert sft.losses[-1] < 0.5 * sft.losses[0]
    assert all(p.grad is None for p in sft._model.parameters())  # nothing left for an optimizer
    assert AutoModelForCausalLM.from_pretrained(Path(result.run_dir) / "final") is not None
    assert (Path(result.run_dir) / "sft_loss.png").exists()
    metrics = [json.loads(x) for x in (Path(result.run_dir) / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics if "sft/loss" in m] == list(range(1, 41))


@pytest.mark.slow
def test_local_rl_warm_started_by_sft_validates_the_student_after_warm_up(tmp_path):
    run_dir = record_teacher_run(tmp_path)
    sft = vl.SFT(source=run_dir, retokenize=True, min_reward=1.0, steps=3, batch_size=2)
    algorithm = vl.LocalRL(
        "tiny",
        warm_start=sft,
        schedule={"steps": 1, "tasks_per_step": 2, "group_size": 2},
        validation={"every": 1},
        sampling={"max_tokens": 8},
    )
    result = vl.Trainer(algorithm, run_dir=tmp_path / "runs", name="rl", progress=False).fit(
        adding_agent, TASKS[:2], TASKS[2:4]
    )
    metrics = [json.loads(x) for x in (Path(result.run_dir) / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics if "sft/loss" in m] == [1, 2, 3]
    assert any("update/loss" in m for m in metrics)
    assert len(sft.losses) == 3 and algorithm.config()["warm_start"]["min_reward"] == 1.0
    # an RL run as a source: its training rollouts (exact token ids), never its validation ones
    again = vl.SFT("tiny", source=result.run_dir, trajectory={"mode": "transition"})
    rows = asyncio.run(again.build_batch(build_tiny_tokenizer()))
    modes = {r.rollout_id: r.mode for r in asyncio.run(_rollouts(Path(result.run_dir)))}
    assert rows.rollout_ids and {modes[r] for r in rows.rollout_ids} == {"train"}
    assert "retokenized" not in rows.stats
    with pytest.raises(ValueError, match="leave its model out"):
        vl.LocalRL("tiny", warm_start=vl.SFT("tiny", source=run_dir))


@pytest.mark.slow
def test_voltrl_train_runs_sft_alone_and_as_local_rls_warm_start_from_yaml(
    tmp_path, capsys, monkeypatch
):
    import yaml

    from voltrl.cli import build_from_config

    here = {"capsys": capsys, "monkeypatch": monkeypatch}
    run_dir = record_teacher_run(tmp_path)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(t) + "\n" for t in TASKS[:2]))
    agent = ADDING_AGENT
    warm = {"source": str(run_dir), "retokenize": True, "steps": 2, "batch_size": 2}
    for name, algorithm in [
        ("alone", {"name": "sft", "model": str(tiny_model_dir(tmp_path)), **warm}),
        ("warm", {"name": "local_rl", "model": "tiny",
                  "schedule": {"steps": 1, "tasks_per_step": 1, "group_size": 2},
                  "sampling": {"max_tokens": 4}, "warm_start": warm}),
    ]:  # fmt: skip
        config = {
            "agent": agent,
            "data": {"train": str(data)},
            "algorithm": algorithm,
            "trainer": {"n_runners": 1, "run_dir": str(tmp_path / "runs"), "name": name},
        }
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
        out = voltrl_here("train", str(tmp_path / f"{name}.yaml"), cwd=tmp_path, **here)
        assert out.returncode == 0, out.stderr[-2000:]
        metrics = (tmp_path / "runs" / name / "metrics.jsonl").read_text()
        assert '"sft/loss"' in metrics
        assert (tmp_path / "runs" / name / "final" / "config.json").exists()
        # the run's train.yaml runs it again (as NAME-2): run for LocalRL with its warm start;
        # for SFT alone (the same SFT settings) built, with those settings
        written = tmp_path / "runs" / name / "train.yaml"
        assert yaml.safe_load(written.read_text())["algorithm"]["name"] == algorithm["name"]
        if name == "alone":
            rebuilt, *_ = build_from_config(yaml.safe_load(written.read_text()))
            sft = rebuilt.algorithm.config()
            assert {k: sft[k] for k in warm} == {**warm, "source": [str(run_dir)]}
            continue
        again = voltrl_here("train", str(written), cwd=tmp_path, **here)
        assert again.returncode == 0, again.stderr[-2000:]
        assert '"sft/loss"' in (tmp_path / "runs" / f"{name}-2" / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_a_resumed_lora_run_puts_its_adapters_back_on_the_warm_started_base(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = record_teacher_run(tmp_path)

    def fit(steps: int, resume: bool) -> tuple[vl.LocalRL, vl.SFT]:
        sft = vl.SFT(source=run_dir, retokenize=True, steps=3, lr=1e-2, batch_size=2)
        algorithm = vl.LocalRL(
            "tiny",
            warm_start=sft,
            schedule={"steps": steps, "tasks_per_step": 1, "group_size": 2},
            checkpoints={"every": 1, "resume": resume},
            sampling={"max_tokens": 4},
            update={"use_lora": True, "lora_r": 4},
        )
        vl.Trainer(algorithm, run_dir=tmp_path / "runs", name="lora", progress=False).fit(
            adding_agent, TASKS[:2]
        )
        return algorithm, sft

    fit(1, resume=False)
    warmed = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "lora" / "warm_start")
    # a model directory of its own, tokenizer included: `voltrl model serve` can serve it
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "runs" / "lora" / "warm_start")
    assert tokenizer.chat_template == build_tiny_tokenizer().chat_template
    fresh = vl.LocalRL("tiny")._load()[0]
    resumed, sft = fit(2, resume=True)
    assert sft.losses == []  # not warmed again
    base = resumed._policies[None].model.get_base_model().model.embed_tokens.weight
    assert torch.equal(base, warmed.model.embed_tokens.weight)
    assert not torch.equal(base, fresh.model.embed_tokens.weight)


@pytest.mark.slow
def test_a_cancelled_warm_up_stops_its_training_thread_between_steps(tmp_path):
    """Ctrl-C cancels ``SFT.run``; the thread training the model must not run on for every
    remaining step (the process would not exit until it had)."""
    run_dir = record_teacher_run(tmp_path)
    tok = build_tiny_tokenizer()
    sft = vl.SFT("tiny", source=run_dir, retokenize=True, steps=1000, batch_size=2)
    batch = asyncio.run(sft.build_batch(tok))

    def cancel_at_step_3(step: int, values: dict[str, float]) -> None:
        if step == 2:
            sft._stop.set()  # what run() does when its task is cancelled

    losses = sft.fit_batch(build_tiny_model(tok), batch, cancel_at_step_3)
    assert len(losses) == 3


def test_a_relative_source_is_recorded_absolute_so_train_yaml_runs_from_anywhere(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    sources = ["runs/teacher", "sqlite:///runs/other.sqlite", "memory", "http://127.0.0.1:9/"]
    recorded = vl.SFT("tiny", source=sources).config()["source"]
    assert recorded == [
        str(tmp_path / "runs" / "teacher"),
        str(tmp_path / "runs" / "other.sqlite"),
        "memory",
        "http://127.0.0.1:9/",
    ]


def test_sft_checks_that_the_students_tool_parser_reads_back_the_calls_it_learns(tmp_path):
    run_dir = record_teacher_run(tmp_path)
    tok = build_tiny_tokenizer()  # its template writes calls in Hermes tags
    for parser in ("hermes", "auto"):
        sft = vl.SFT("tiny", source=run_dir, retokenize=True, tool_parser=parser)
        assert asyncio.run(sft.build_batch(tok)).stats["retokenized"] > 0
        assert sft.config()["tool_parser"] == parser
    json_parser = vl.SFT("tiny", source=run_dir, retokenize=True, tool_parser="json")
    with pytest.raises(VoltRLError) as refused:
        asyncio.run(json_parser.build_batch(tok))
    said = str(refused.value)
    assert '\'<tool_call>\\n{"name": "add"' in said
    assert "are not read back by tool parser 'json' (the 'hermes' parser reads it)" in said
    with pytest.raises(ValueError, match=r"unknown tool parser 'xml' \(choose one of: auto, "):
        vl.SFT("tiny", source=run_dir, tool_parser="xml")
    assert "tool_parser" not in vl.SFT("tiny", source=run_dir).config()  # as recorded before

    # under LocalRL, the parser LocalRL serves with
    warm = vl.SFT(source=run_dir, retokenize=True, steps=1, batch_size=2)
    algorithm = vl.LocalRL("tiny", warm_start=warm, serving={"tool_parser": "json"})
    trainer = vl.Trainer(algorithm, run_dir=tmp_path / "runs", name="rl", progress=False)
    with pytest.raises(VoltRLError, match="not read back by tool parser 'json'"):
        trainer.fit(adding_agent, TASKS[:2])
