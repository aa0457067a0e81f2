"""``voltrl show``: a real short run (an agent calling a tool through the gateway against the
scripted fake backend, one flaky attempt, three steps of metrics) shown as a run and as one
rollout, from its run directory and from a store server; clear errors for what is not there."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from fake_openai_backend import FakeBackend, tool_then_answer
from helpers import fake_trainer
from openai import AsyncOpenAI
from rich.console import Console

import voltrl as vl
from voltrl.algorithms.base import Algorithm
from voltrl.cli import main
from voltrl.observability.metrics import summarize
from voltrl.observability.run_views import Found, RolloutView
from voltrl.observability.show import render_rollout, sparkline
from voltrl.store.sql import SQLStore
from voltrl.types import Attempt, LLMCall, Rollout, Run, Task

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
QUESTION = "What is 17 + 25?"
CURVE = sparkline([1 / 3 / 2, 2 / 3 / 2, 1 / 2])
"""The train reward's curve: one task of two right at step 0, 1, 2, rewarded 1/3, 2/3, 1."""
flaked: list[str] = []


@vl.rollout
async def solver(task: dict[str, Any], llm: vl.LLM, ctx: Any) -> float:
    """Asks the model, runs the ``add`` tool it calls, asks again; its first attempt at the
    ``flaky`` task fails. Reward: (step + 1) / 3 for the right answer, else 0."""
    if task.get("flaky") and not flaked:
        flaked.append(ctx.rollout_id)
        raise RuntimeError("flaky tool server went away")
    llm = llm.for_agent("solver")
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    messages = [
        {"role": "system", "content": "You add numbers with the add tool."},
        {"role": "user", "content": task["question"]},
    ]
    with vl.span("agent solver") as outer:
        reply = await client.chat.completions.create(
            model=llm.model, messages=messages, tools=TOOLS
        )
        [call] = reply.choices[0].message.tool_calls or []
        with vl.span("tool add") as inner:
            inner.parent_id = outer.span_id  # vl.span does not link nested spans itself
            args = json.loads(call.function.arguments)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": str(sum(args.values()))}
        )
        final = await client.chat.completions.create(
            model=llm.model, messages=messages, tools=TOOLS
        )
    right = final.choices[0].message.content == str(task["answer"])
    reward = (task["step"] + 1) / 3 if right else 0.0
    vl.emit_reward(reward, agents="solver")
    return reward


class Steps(Algorithm):
    """Three steps: the train tasks, then the validation ones, and a falling "loss"."""

    name = "steps"

    def __init__(self, steps: int = 3) -> None:
        self.steps = steps

    async def train(self, ctx: Any, train: list[Task], val: list[Task] | None) -> None:
        for step in range(self.steps):
            await ctx.publish({})  # a new resources version per step
            stats = {}
            for mode, tasks in (("train", train), ("val", val or [])):
                rows = [Task(input={**t.input, "step": step}) for t in tasks]
                stats.update(summarize(await ctx.run_rollouts(rows, mode)).flat(f"{mode}/"))
            ctx.log(step, **stats, **{"update/loss": 1 / (step + 1), "update/kl": 0.01 * step})


async def make_run(run_dir: Path) -> None:
    flaked.clear()  # one flaky attempt per run: a worker may make the module's run again
    async with FakeBackend() as fb:
        fb.script = tool_then_answer('{"a": 17, "b": 25}', "42")
        llm = vl.LLM(endpoint=fb.url, model="m")
        trainer = fake_trainer(None, run_dir, llm, algorithm=Steps(), name="demo")
        rows = [
            {"question": QUESTION, "answer": 42, "flaky": True},
            {"question": QUESTION, "answer": 43},
        ]
        await trainer.fit_async(solver, rows, rows[1:])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("show") / "runs"
    asyncio.run(make_run(run_dir))
    return run_dir


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")


def stored(run_dir: Path) -> tuple[Run, list[Rollout]]:
    async def read() -> tuple[Run, list[Rollout]]:
        store = SQLStore(run_dir / "demo" / "store.sqlite")
        try:
            [run] = await store.list_runs()
            return run, await store.query_rollouts(run_id=run.run_id)
        finally:
            await store.close()

    return asyncio.run(read())


def show(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["show", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def line_of(out: str, start: str) -> str:
    [line] = [x for x in out.splitlines() if x.startswith(start)]
    return line


def cells(out: str, metric: str) -> list[str]:
    """The cells after ``metric`` on its line of a metrics table."""
    return re.split(r"\s{2,}", line_of(out, metric).strip())[1:]


def test_a_run_shows_its_summary_reward_statistics_and_metric_curves(runs: Path, capsys) -> None:
    run, _ = stored(runs)
    rc, out, _ = show(capsys, "demo", "--run-dir", str(runs))
    assert rc == 0
    assert "run demo" in out and run.run_id in out and "finished" in out
    assert "fit · algorithm steps" in out
    train = line_of(out, "│ train")  # rewards 1/3, 2/3, 1 for one task of two, 0 for the other
    assert "│        6 │      0 │         0 │       0.333 │ 0.385 │ 0.000 │ 1.000 │" in train
    # three validations: the first, the last and all of them; the last is the result
    assert "│        1 │      0 │         0 │       0.000 │" in line_of(out, "│ val, last")
    assert "│        3 │" in line_of(out, "│ val, all 3") and "│ all        │        9 │" in out
    assert "result: reward 0.000 at the last validation (1 rollout)" in out
    metrics = [x.split()[0] for x in out.splitlines() if "/" in x and "steps" in x]
    # the reward means first, then the order the dashboard charts them in (FIRST_METRICS)
    assert metrics[:3] == ["train/reward_mean", "val/reward_mean", "train/reward_std"]
    assert cells(out, "train/reward_mean") == [CURVE, "0.1667 → 0.5", "0.1667", "0.5", "3 steps"]
    assert cells(out, "update/loss") == ["█▃▁", "1 → 0.3333", "0.3333", "1", "3 steps"]
    assert "update/kl" in metrics
    assert "runs/demo/metrics.jsonl" in out
    assert "RuntimeError" not in out  # the flaky rollout succeeded on its second attempt
    # five of the nine rollouts listed, and said so
    assert "5 of the run's 9 rollouts shown: voltrl dashboard lists them all" in out


def test_a_run_directory_shows_that_run(runs: Path, capsys, monkeypatch) -> None:
    run, _ = stored(runs)
    monkeypatch.chdir(runs.parent)
    for given in (str(runs / "demo"), "runs/demo", "runs/demo/"):
        rc, out, _ = show(capsys, given)
        assert rc == 0 and "run demo" in out and run.run_id in out, given
        assert "train/reward_mean" in out  # its metrics.jsonl, beside its store
        if not given.startswith("/"):  # a long path wraps in the table's title
            assert f"voltrl show {given} ROLLOUT_ID shows one" in out


def test_a_rollout_shows_its_attempts_conversation_rewards_and_spans(runs: Path, capsys) -> None:
    _, rollouts = stored(runs)
    [flaky] = [r for r in rollouts if r.attempt_count == 2]
    rc, out, _ = show(capsys, "demo", flaky.rollout_id[:12], "--run-dir", str(runs))
    assert rc == 0
    assert f"rollout {flaky.rollout_id}" in out and '"flaky": true' in out
    assert "resources  version 2" in out and "reward     0.3333" in out
    failed = line_of(out, "│ 1 ")
    assert "failed" in failed and "RuntimeError: flaky tool server went away" in failed
    assert "traceback of attempt #1:" in out and 'raise RuntimeError("flaky' in out
    assert "frames of voltrl, the standard library and installed packages hidden" in out
    assert "core/runtime/runner.py" not in out  # the agent's own frames only, unless --full
    header = line_of(out, "call 1/2 · attempt #2 · solver · m · finish tool_calls")
    assert "prompt + 18 response tokens" in header  # one fake token per character
    assert "system       You add numbers with the add tool." in out
    assert f"user         {QUESTION}" in out and "tools        add" in out
    assert '→ assistant  tool call add({"a": 17, "b": 25})' in out
    assert "…            3 earlier messages, as in call 1" in out  # call 2 repeats call 1's
    assert "tool         add ⇒ 42" in out and "→ assistant  42" in out
    assert line_of(out, "│ 0.3333 ").split("│")[1:6] == [
        " 0.3333 ",
        " reward ",
        " emit   ",
        " -    ",
        " solver ",
    ]
    assert "└── agent solver" in out and "    └── tool add" in out

    rc, full, _ = show(capsys, "demo", flaky.rollout_id, "--run-dir", str(runs), "--full")
    assert "earlier messages" not in full and full.count("You add numbers") == 2
    assert "core/runtime/runner.py" in full


def test_what_is_not_there_is_a_one_line_error_with_status_2(runs: Path, capsys) -> None:
    run, _ = stored(runs)
    rc, out, err = show(capsys, "nope", "--run-dir", str(runs))
    assert rc == 2 and not out
    assert err == f"voltrl: error: no run 'nope' in {runs}; runs there: demo ({run.run_id})\n"
    rc, _, err = show(capsys, "demo", "ro-nope", "--run-dir", str(runs))
    assert rc == 2 and err.startswith("voltrl: error: no rollout 'ro-nope' in run demo")
    assert "it has 9 rollouts" in err and err.count("\n") == 1
    rc, _, err = show(capsys, run.run_id, "ro-", "--run-dir", str(runs))
    assert rc == 2 and "'ro-' matches 9 rollouts of run demo" in err and err.count("\n") == 1
    rc, _, err = show(capsys, "demo", "--store", str(runs / "none.sqlite"))
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(f"voltrl: error: store {runs / 'none.sqlite'} does not exist:")


def test_a_name_of_several_runs_shows_the_latest_and_says_so(runs: Path, tmp_path, capsys) -> None:
    shutil.copytree(runs / "demo", tmp_path / "demo")
    first, _ = stored(tmp_path)
    error = "the endpoint went away"
    later = Run(name="demo", kind="dev", created_at=first.created_at + 60, error=error)

    async def add() -> None:
        store = SQLStore(tmp_path / "demo" / "store.sqlite")
        await store.add_run(later)
        await store.close()

    asyncio.run(add())
    rc, out, _ = show(capsys, "demo", "--run-dir", str(tmp_path))
    assert rc == 0 and "2 runs are named 'demo': showing the latest, " + later.run_id in out
    assert f"the others: {first.run_id}" in out and "the endpoint went away" in out
    assert "no rollouts" in out
    rc, out, _ = show(capsys, first.run_id, "--run-dir", str(tmp_path))
    assert rc == 0 and "runs are named" not in out and "│ all        │        9 │" in out


def test_over_a_store_server_the_reward_curve_comes_from_the_store(runs, tmp_path, capsys) -> None:
    from voltrl._http.serving import serve_in_thread
    from voltrl.store.http.endpoints import store_app

    store = SQLStore(runs / "demo" / "store.sqlite")
    _, rollouts = stored(runs)
    with serve_in_thread(store_app(store, token="secret")) as server:
        url = server.url
        args = ("--store", url, "--token", "secret")
        rc, out, _ = show(capsys, "demo", *args, "--run-dir", str(tmp_path))
        assert rc == 0 and f"store     {url}" in out
        curve = cells(out, "train reward by resources version")
        assert curve == [CURVE, "0.1667 → 0.5", "0.1667", "0.5", "versions 2…4"]
        assert "no metrics.jsonl here" in out and "update/loss" not in out
        rid = rollouts[-1].rollout_id
        rc, out, _ = show(capsys, "demo", rid, *args)
        assert rc == 0 and f"rollout {rid}" in out and "→ assistant  42" in out
    asyncio.run(store.close())


def test_rendering_folds_long_contents_and_says_when_there_are_no_token_ids() -> None:
    rollout = Rollout(task=Task(input={"q": 1}), run_id="run-1", status="succeeded")
    attempt = Attempt(
        rollout_id=rollout.rollout_id,
        index=1,
        worker_id="w",
        lease_expires_at=0,
        status="failed",
        error="ValueError: bad [/] input",  # no rich markup: printed as it is
    )
    long = "\n".join(f"line {i}" for i in range(100))
    messages = [
        {"role": "system", "content": "[bold]as is[/bold]"},
        {"role": "user", "content": long},
    ]
    call = LLMCall(
        rollout_id=rollout.rollout_id,
        attempt_id=attempt.attempt_id,
        request={"messages": messages},
        response={"choices": [{"message": {"role": "assistant", "content": "ok"}}]},
        finish_reason="stop",
    )
    run = Run(run_id="run-1", name="r", kind="dev")
    view = RolloutView(Found(None, run, "here", None), rollout, [attempt], [call], [], [])
    console = Console(record=True, width=120)
    render_rollout(view, console)
    out = console.export_text()
    assert "no token ids" in out and "line 7" in out and "line 99" in out
    assert "line 50" not in out and "characters folded" in out
    assert "no rewards" in out and "no spans" in out
    assert "ValueError: bad [/] input" in out and "[bold]as is[/bold]" in out
    render_rollout(view, console, full=True)
    assert "line 50" in console.export_text()


def test_a_rollout_that_returned_its_reward_says_none_was_emitted() -> None:
    rollout = Rollout(task=Task(input={}), run_id="run-1", status="succeeded", reward=0.0)
    run = Run(run_id="run-1", name="r", kind="dev")
    view = RolloutView(Found(None, run, "here", None), rollout, [], [], [], [])
    console = Console(record=True, width=120)
    render_rollout(view, console)
    out = console.export_text()
    assert re.search(r"^reward +0 *$", out, re.M)
    assert "no rewards emitted (the rollout returned its reward, 0)" in out
    assert not re.search(r"^no rewards *$", out, re.M)


def test_the_statistics_table_counts_each_final_status() -> None:
    from voltrl.observability.metrics import format_stats_table

    statuses = ["succeeded", "succeeded", "failed", "cancelled", "cancelled", "cancelled"]
    rollouts = [
        Rollout(task=Task(input={}), run_id="r", status=s, reward=1.0 if s == "succeeded" else None)
        for s in statuses
    ]
    console = Console(record=True, width=80)  # a plain terminal: no header wraps
    stats = {"train": summarize(rollouts), "val": summarize(rollouts), "all": summarize(rollouts)}
    console.print(format_stats_table("rollouts", stats))
    out = console.export_text()
    [header] = [line for line in out.splitlines() if line.startswith("┃ ")]
    assert [c.strip() for c in header.split("┃")[1:-1]] == [
        "",
        "rollouts",
        "failed",
        "cancelled",
        "reward mean",
        "std",
        "min",
        "max",
    ]
    assert [c.strip() for c in line_of(out, "│ all").split("│")[1:-1]][:5] == [
        "all",
        "6",
        "1",
        "3",
        "1.000",
    ]


def test_sparkline_scales_to_its_range_and_width() -> None:
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([2.0, 2.0]) == "▄▄" and sparkline([]) == ""
    assert sparkline(range(1000), width=10) == "▁▂▃▃▄▅▆▆▇█"


def test_control_characters_in_stored_text_never_reach_the_terminal() -> None:
    from voltrl._console import printable
    from voltrl.types import Attempt

    attempt = Attempt(
        rollout_id="ro-x",
        index=1,
        worker_id="w",
        lease_expires_at=0,
        error="boom \x1b[41;97mRED\x1b[0m \x1b]0;title\x07 \x0f",
    )
    shown = printable({"attempts": [attempt], "text": "tab\tand\nnewline"})
    assert shown["attempts"][0].error == "boom \\x1b[41;97mRED\\x1b[0m \\x1b]0;title\\x07 \\x0f"
    assert shown["text"] == "tab\tand\nnewline"  # layout characters stay
    assert attempt.error.startswith("boom \x1b")  # the record itself is left alone
