"""The token-drift audit per agent framework, on a real pretrained model: each framework
sample's own agent, unchanged, runs a handful of rollouts against SmolLM2-135M-Instruct served
by VoltRL's engine (``voltrl model serve``), every call recorded through the gateway with its
sampled token ids; then ``voltrl audit``'s functions audit each run with the model's tokenizer.

    python benchmarks/drift_audit.py                      # ~10 minutes on 2 shared cores
    python benchmarks/drift_audit.py --warm-up-steps 10   # + the tool samples warmed: ~19
    python benchmarks/drift_audit.py --only autogen planted --tasks 4
    python benchmarks/drift_audit.py --reaudit            # audit the recorded runs again

Prints one Markdown table (framework, sample, rollouts, calls, audited, identical, diverging
checks by cause with a decoded example, not checkable by reason, continuations merged vs
split) and writes it to ``<out>/drift_audit/table.md``, with ``results.json`` (every run's
whole audit, ``voltrl audit --json``'s shape, plus each divergence's cause) and
``<name>.audit.txt`` (``voltrl audit``'s text) per run. The causes are this script's reading of
each divergence (:func:`classify`): where it falls against the previous call's prompt and
answer, and what the decoded texts on both sides differ by.

Two rows are agents of this file, bare OpenAI clients making two chat calls: ``echo`` sends
the model's first answer back unchanged (the control: its second call continues the first
and merges, unless the model sampled a token split that re-encoding its text does not give,
``['\\n\\n', '1']`` where the tokenizer makes ``['\\n', '\\n', '1']``), ``planted`` sends
it back with its whitespace collapsed and stripped (or, when that changes nothing, without
its first character): the audit must catch every planted change and locate it inside the
first answer, at the first changed character (or at an earlier token split of that kind).

The stock SmolLM2 never calls a tool (0 of 8 sampled answers, ``docs/models.md``), so in the
tool-using samples every rollout is one call and their continuation checks have nothing to
compare. ``--warm-up-steps N`` also records each tool sample's scripted teacher
(``samples/teacher_server.py``) through its framework, fine-tunes SmolLM2 on those rollouts
for N steps (``vl.SFT``, every weight; enough for it to write ``<tool_call>`` turns, not to
solve the tasks) and audits the tool samples again on that copy (``--tool-model DIR`` reuses
a warmed model directory instead). AgentScope (``werewolf``) runs in ``.venv-agentscope``
(``make test-envs`` or ``make .venv-agentscope/.deps``); without it its row says so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

import voltrl as vl

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples"
MODEL = "smollm2-135m-instruct"
PY = sys.executable
AS_PY = ROOT / ".venv-agentscope" / "bin" / "python"
TEACHER_SEED = 777
"""Task seed of the teachers' rollouts (the audited rollouts use seed 0: other tasks)."""


# ---- the planted-drift agent and its control ---------------------------------------------------
PLANTED_SYSTEM = "You are a helpful assistant. Answer briefly."
PLANTED_TASKS = [
    "List three fruits, one per line.",
    "List three colours, one per line.",
    "Name two planets, one per line.",
    "Write two short lines about the sea.",
    "List three animals, one per line.",
    "Give two tips for sleeping well, one per line.",
    "List three vegetables, one per line.",
    "Write a haiku about rain.",
]
FOLLOW_UP = "Now say it again in one sentence."


def planted_change(answer: str) -> tuple[str, str]:
    """The answer as the planted agent sends it back, and what was changed: its whitespace
    collapsed and stripped, or, where that changes nothing, its first character dropped."""
    collapsed = " ".join(answer.split())
    if collapsed != answer:
        return collapsed, "whitespace collapsed and stripped"
    return answer[1:], "first character dropped"


async def _two_calls(task: dict[str, Any], llm: vl.LLM, change: bool) -> float:
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": PLANTED_SYSTEM},
        {"role": "user", "content": task["question"]},
    ]
    first = await client.chat.completions.create(
        model=llm.model, messages=messages, **llm.sampling_parameters
    )
    answer = first.choices[0].message.content or ""
    sent, how = planted_change(answer) if change else (answer, "unchanged")
    vl.emit_event("sent_back", original=answer, sent=sent, change=how)
    messages += [{"role": "assistant", "content": sent}, {"role": "user", "content": FOLLOW_UP}]
    await client.chat.completions.create(
        model=llm.model, messages=messages, **llm.sampling_parameters
    )
    await client.close()
    return 0.0


@vl.rollout
async def planted_agent(task: dict[str, Any], llm: vl.LLM) -> float:
    """Two calls; the second sends the first answer back changed (:func:`planted_change`)."""
    return await _two_calls(task, llm, change=True)


@vl.rollout
async def echo_agent(task: dict[str, Any], llm: vl.LLM) -> float:
    """Two calls; the second sends the first answer back as the model gave it (the control)."""
    return await _two_calls(task, llm, change=False)


# ---- what runs ----------------------------------------------------------------------------------
@dataclass
class Ctx:
    """What every sample's command needs."""

    endpoint: str
    model: str
    runs: Path
    data: Path
    tasks: int
    max_tokens: int
    temperature: float
    tokenizer: str


@dataclass
class Spec:
    """One row: a framework's sample and the command that runs its ``dev`` (``run.py dev`` or
    ``voltrl dev``); ``teacher``: whether it has a scripted teacher for the warm-up."""

    key: str
    framework: str
    sample: str
    command: Callable[[Ctx, str], list[str]]
    python: Path | str = PY
    uses_tools: bool = False
    teacher: bool = False
    note: str = ""


def _load(path: Path, name: str) -> Any:
    """The module at ``path``, its directory on ``sys.path`` meanwhile (a sample's modules
    import each other by bare names, ``agent``, ``data``: those are forgotten again)."""
    before, sys.path[:0] = set(sys.modules), [str(path.parent)]
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))
        for added in set(sys.modules) - before:
            if not added.startswith(("voltrl", "openai", "httpx")):
                sys.modules.pop(added, None)


def _jsonl(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _voltrl_dev(agent: str, data: Path, c: Ctx, name: str) -> list[str]:
    return [
        "-m", "voltrl.cli", "dev", agent, "--data", str(data), "--llm-endpoint", c.endpoint,
        "--model", c.model, "--max-tokens", str(c.max_tokens), "--temperature",
        str(c.temperature), "--run-dir", str(c.runs), "--name", name,
        "--skip-endpoint-check",
    ]  # fmt: skip


def _common(c: Ctx, name: str, *, temperature: bool = True) -> list[str]:
    out = ["--endpoint", c.endpoint, "--model", c.model, "--max-tokens", str(c.max_tokens)]
    out += ["--run-dir", str(c.runs), "--name", name]
    return out + (["--temperature", str(c.temperature)] if temperature else [])


def quickstart(c: Ctx, name: str) -> list[str]:
    lines = (SAMPLES / "quickstart" / "tasks.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    data = _jsonl(rows[: c.tasks], c.data / "quickstart.jsonl")
    return _voltrl_dev("samples/quickstart/agent.py:agent", data, c, name)


def calculator(c: Ctx, name: str) -> list[str]:
    make = _load(SAMPLES / "calculator" / "data.py", "drift_calculator_data").make_tasks
    seed = TEACHER_SEED if c.model == "teacher" else 0
    data = _jsonl(make(c.tasks, seed), c.data / f"calculator-{seed}.jsonl")
    return _voltrl_dev("samples/calculator/agent.py:calculator_agent", data, c, name)


def planted(c: Ctx, name: str) -> list[str]:
    data = _jsonl([{"question": q} for q in PLANTED_TASKS[: c.tasks]], c.data / "planted.jsonl")
    return _voltrl_dev(f"{Path(__file__).resolve()}:planted_agent", data, c, name)


def echo(c: Ctx, name: str) -> list[str]:
    data = _jsonl([{"question": q} for q in PLANTED_TASKS[: c.tasks]], c.data / "planted.jsonl")
    return _voltrl_dev(f"{Path(__file__).resolve()}:echo_agent", data, c, name)


def sql_agent(c: Ctx, name: str) -> list[str]:
    return ["samples/sql_agent/run.py", "dev", *_common(c, name), "--limit", str(c.tasks)]


def autogen(c: Ctx, name: str) -> list[str]:
    seed = ["--seed", str(TEACHER_SEED)] if c.model == "teacher" else []
    return ["samples/autogen_calc/run.py", "dev", *_common(c, name), "--n", str(c.tasks), *seed]


def calc_mcp(c: Ctx, name: str) -> list[str]:  # its dev samples greedily, no --temperature
    seed = ["--seed", str(TEACHER_SEED)] if c.model == "teacher" else []
    common = _common(c, name, temperature=False)
    return ["samples/calc_mcp/run.py", "dev", *common, "--tasks", str(c.tasks), *seed]


def agent_service(c: Ctx, name: str) -> list[str]:
    seed = ["--seed", str(TEACHER_SEED)] if c.model == "teacher" else []
    common = _common(c, name)
    return ["samples/agent_service/run.py", "dev", *common, "--n", str(c.tasks), *seed]


def werewolf(c: Ctx, name: str) -> list[str]:
    return [
        "samples/werewolf/run.py", "dev", *_common(c, name), "--games", "1", "--rules", "short",
        "--max-rounds", "1", "--history-tokens", "400", "--tokenizer", c.tokenizer,
    ]  # fmt: skip


SPECS = [
    Spec("quickstart", "bare OpenAI client", "quickstart", quickstart),
    Spec("calculator", "OpenAI client + tools", "calculator", calculator, uses_tools=True,
         teacher=True),
    Spec("langgraph", "LangChain / LangGraph", "sql_agent", sql_agent),
    Spec("autogen", "AutoGen 0.7", "autogen_calc", autogen, uses_tools=True, teacher=True),
    Spec("agent_framework", "Microsoft Agent Framework", "calc_mcp", calc_mcp, uses_tools=True,
         teacher=True, note="its dev samples greedily"),
    Spec("openai_agents", "OpenAI Agents SDK", "agent_service", agent_service, uses_tools=True,
         teacher=True),
    Spec("agentscope", "AgentScope 2.x", "werewolf", werewolf, python=AS_PY,
         note="1 game, short rules, 1 round, 400-token histories"),
    Spec("echo", "bare OpenAI client (control)", "this file: echo_agent", echo,
         note="answer sent back unchanged"),
    Spec("planted", "bare OpenAI client (planted drift)", "this file: planted_agent", planted,
         note="answer sent back with its whitespace collapsed (else its first character dropped)"),
]  # fmt: skip
BY_KEY = {s.key: s for s in SPECS}


# ---- processes ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # each process compiles its imports once
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _wait_for(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited ({proc.returncode}): {log.read_text()[-800:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


@contextlib.contextmanager
def serving(args: list[str], log: Path) -> Iterator[str]:
    """Run a server command with ``--port P`` appended; yield its ``.../v1`` URL."""
    port = _free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [PY, *args, "--port", str(port)], cwd=ROOT, env=_env(), stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}/v1"
        try:
            _wait_for(url, proc, log)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_sample(spec: Spec, ctx: Ctx, name: str, log: Path, timeout: float) -> dict[str, Any]:
    """Run one sample's ``dev`` as its own process; its exit status, seconds and output tail."""
    shutil.rmtree(ctx.runs / name, ignore_errors=True)  # else the samples pick NAME-2
    started = time.monotonic()
    if not Path(spec.python).exists():
        return {"rc": None, "seconds": 0.0, "error": f"{spec.python} does not exist"}
    cmd = [str(spec.python), *spec.command(ctx, name)]
    with log.open("wb") as out:
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    return {"rc": rc, "seconds": round(time.monotonic() - started, 1), "cmd": cmd, "tail": tail}


# ---- auditing -----------------------------------------------------------------------------------
async def audit(run_path: Path, tokenizer: str) -> dict[str, Any]:
    """The run's audit (:func:`~voltrl.observability.audit_views.audit_run`, as ``voltrl
    audit`` loads it), its calls by id, its rollouts' statuses, and its text rendering."""
    import io

    from rich.console import Console

    from voltrl._console import printable
    from voltrl.cli.audit import render
    from voltrl.observability.audit_views import as_json, audit_run
    from voltrl.observability.run_views import find_run

    found = await find_run(str(run_path))
    try:
        result = await audit_run(found, tokenizer=tokenizer)
        calls = {}
        for rollout, ra in result.rollouts:
            if ra.attempt_id:
                for c in await found.store.get_llm_calls(rollout.rollout_id, ra.attempt_id):
                    calls[c.call_id] = c
        spans = {}
        for rollout, _ in result.rollouts:
            spans[rollout.rollout_id] = [
                s for s in await found.store.get_spans(rollout.rollout_id) if s.name == "sent_back"
            ]
    finally:
        await found.store.close()
    text = io.StringIO()
    render(printable(result), Console(file=text, width=160, highlight=False, markup=False))
    return {"audit": result, "json": as_json(result), "calls": calls, "spans": spans,
            "text": text.getvalue()}  # fmt: skip


def _decode(tok: Any, ids: Sequence[int], skip: bool = False) -> str:
    return str(tok.decode(list(ids), skip_special_tokens=skip))


def _shared_chars(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _nows(text: str) -> str:
    return re.sub(r"\s+", "", text)


def pieces(tok: Any, ids: Sequence[int]) -> str:
    """Each token decoded on its own: ``['\\n\\n', '1', '.']``, so that two tokenizations of
    one text show as such."""
    return "[" + ", ".join(repr(_decode(tok, [i])) for i in ids) + "]"


def _role_at(text: str, at: int) -> str:
    """The ChatML role of the turn that character ``at`` of ``text`` falls in."""
    start = text.rfind("<|im_start|>", 0, at)
    return text[start + 12 :].split("\n", 1)[0] if start >= 0 else "?"


def classify(check_name: str, call: Any, previous: Any, d: Any, tok: Any) -> tuple[str, str]:
    """A diverging check's cause, as a short phrase, and its context decoded token by token."""
    marked = (
        f"{_decode(tok, d.before)!r} ⟦expected {pieces(tok, d.expected)} ≠ recorded "
        f"{pieces(tok, d.recorded)}⟧"
    )
    if check_name == "template":
        return "the engine's prompt is not the chat template's rendering", marked
    if previous is None:
        return "", marked
    p_len, r_len, pos = len(previous.prompt_token_ids), len(previous.response_token_ids), d.position
    recorded = call.prompt_token_ids
    answer = _decode(tok, previous.response_token_ids, skip=True).strip()
    if pos >= len(recorded):
        if pos <= p_len:
            return "the previous prompt sent again, without its answer", marked
        return "the prompt stops inside the previous answer", marked
    if pos < p_len:  # the previous prompt itself was not kept
        text = _decode(tok, recorded)
        if not answer or answer not in text:
            return "a new conversation: the previous answer is not in the prompt", marked
        changed = _role_at(text, len(_decode(tok, recorded[:pos])) + 1)
        inside = _role_at(text, text.index(answer))
        return (
            f"history re-rendered: the {changed} turn changed before the previous answer, "
            f"which comes back inside a {inside} turn"
        ), marked
    k = pos - p_len
    expected_rest = _decode(tok, previous.response_token_ids[k:], skip=True)
    recorded_rest = _decode(tok, recorded[pos:])
    whole = _decode(tok, previous.response_token_ids)
    if "<tool_call>" in whole and "<tool_call>" in _decode(
        tok, previous.response_token_ids[: k + 1]
    ):
        what = "tool call re-serialized"
        if _nows(recorded_rest).startswith(_nows(expected_rest)):
            what += " (whitespace only)"
        return what, marked
    if recorded_rest.startswith(expected_rest):
        return "the previous answer re-tokenized: same text, other ids", marked
    common = _shared_chars(expected_rest, recorded_rest)
    pieces_at = [previous.response_token_ids[k:][:1], recorded[pos : pos + 1]]
    if common >= max(len(_decode(tok, ids)) for ids in pieces_at):
        return "the previous answer re-tokenized (same text, other ids; changed later)", marked
    if _nows(recorded_rest).startswith(_nows(expected_rest)):
        return "whitespace changed in the previous answer (stripped or collapsed)", marked
    if k < r_len:
        return "the previous answer was sent back changed", marked
    return "something was inserted after the previous answer", marked


def analyse(result: dict[str, Any], tok: Any) -> dict[str, Any]:
    """Causes of every diverging check, counted, with one decoded example each."""
    audit_ = result["audit"]
    calls = result["calls"]
    causes: Counter[str] = Counter()
    examples: dict[str, dict[str, Any]] = {}
    located = []
    for c in audit_.summary.diverging:
        for name, check in (("template", c.template), ("continuation", c.continuation)):
            if check.outcome != "diverges":
                continue
            call, prev = calls.get(c.call_id), calls.get(c.previous_call_id or "")
            if call is None or (name == "continuation" and prev is None):
                cause, detail = "call not found", check.divergence.marked()
            else:
                cause, detail = classify(name, call, prev, check.divergence, tok)
            key = f"{name}: {cause}"
            causes[key] += 1
            example = {"call_id": c.call_id, "agent": c.agent_name, "marked": detail}
            examples.setdefault(key, {**example, "position": check.divergence.position})
            if name == "continuation" and prev is not None:
                located.append(_located(prev, check.divergence, tok))
    return {"causes": dict(causes.most_common()), "examples": examples, "located": located}


def _located(previous: Any, d: Any, tok: Any) -> dict[str, Any]:
    """Where a continuation divergence falls: inside the previous answer (token ``k`` of it)
    or before it; the answer's text up to there."""
    p_len = len(previous.prompt_token_ids)
    k = d.position - p_len
    inside = 0 <= k <= len(previous.response_token_ids)
    return {
        "call_id": previous.call_id,
        "inside_previous_answer": inside,
        "answer_token": k if inside else None,
        "answer_before": _decode(tok, previous.response_token_ids[:k]) if inside else None,
    }


def planted_check(result: dict[str, Any], tok: Any) -> dict[str, Any]:
    """Did the audit catch every planted change, and where? Each rollout's second call must
    diverge inside the first call's answer, the text before the divergence unchanged: ``at
    the change`` when the diverging token holds the first changed character; ``earlier``
    when it comes before it and both sides still read the same text there (the model sampled
    a token split that re-encoding does not give: a real divergence, found first)."""
    out: dict[str, Any] = {"rollouts": 0, "caught": 0, "at_change": 0, "earlier": 0}
    misses, earlier = [], []
    for rollout, ra in result["audit"].rollouts:
        sent = result["spans"].get(rollout.rollout_id) or []
        if len(ra.calls) < 2 or not sent:
            continue
        out["rollouts"] += 1
        second = ra.calls[1]
        d = second.continuation.divergence
        if second.continuation.outcome != "diverges" or d is None:
            misses.append({"rollout": rollout.rollout_id, "why": second.continuation.describe()})
            continue
        out["caught"] += 1
        first = result["calls"][ra.calls[0].call_id]
        original, changed = sent[0].attributes["original"], sent[0].attributes["sent"]
        changed_at = _shared_chars(original, changed)
        k = d.position - len(first.prompt_token_ids)
        before = _decode(tok, first.response_token_ids[: max(k, 0)])
        token = _decode(tok, first.response_token_ids[k : k + 1]) if k >= 0 else ""
        where = {"rollout": rollout.rollout_id, "answer_token": k, "changed_char": changed_at}
        if k < 0 or not (original.startswith(before) and changed.startswith(before)):
            misses.append({**where, "why": "not inside the first answer's unchanged text"})
        elif len(before) <= changed_at < len(before) + len(token):
            out["at_change"] += 1
        elif len(before) + len(token) <= changed_at:
            out["earlier"] += 1
            earlier.append({**where, "marked": classify("continuation", None, None, d, tok)[1]})
        else:
            misses.append({**where, "why": "after the first changed character"})
    return {**out, "misses": misses, "earlier_examples": earlier}


# ---- the table ----------------------------------------------------------------------------------
def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _cell(text: str) -> str:
    """Text for a Markdown table cell: no pipes, no line breaks."""
    return text.replace("|", "\\|").replace("\n", "\\n")


REASON_WORDS = {
    "continuation/first_call": "first call",
    "continuation/other_model": "other model",
    "continuation/previous_no_token_ids": "previous call without ids",
    "template/no_tokenizer": "no tokenizer",
}


def row_of(entry: dict[str, Any]) -> list[str]:
    """One table row of a run's entry (see :func:`main`)."""
    spec, model = BY_KEY[entry["key"]], entry["model_label"]
    head = [spec.framework, f"{spec.sample} ({model})" if model != "SmolLM2" else spec.sample]
    counts = entry.get("summary")
    if counts is None:
        return [*head, "-", "-", "-", "-", _cell(f"not run: {_cut(entry['why'], 300)}"), "-", "-"]
    status = entry["statuses"]
    ok = status.get("succeeded", 0)
    other = ", ".join(f"{v} {k}" for k, v in status.items() if k != "succeeded")
    rollouts = f"{ok}" + (f" (+{other})" if other else "")
    causes = entry["analysis"]["causes"]
    diverging = str(counts["diverging"])
    if causes:
        top = next(iter(causes))
        example = _cut(entry["analysis"]["examples"][top]["marked"], 160)
        listed = "; ".join(f"{n} x {cause}" for cause, n in causes.items())
        diverging += f": {listed}; e.g. {example}"
    if "planted" in entry:
        p = entry["planted"]
        diverging += (
            f" **planted: {p['caught']}/{p['rollouts']} caught inside the first answer: "
            f"{p['at_change']} at the first changed character, {p['earlier']} at an earlier "
            f"re-tokenized token; {len(p['misses'])} missed or misplaced**"
        )
    reasons = ", ".join(f"{REASON_WORDS.get(k, k)} {v}" for k, v in counts["reasons"].items())
    not_checkable = f"{counts['not_checkable']}" + (
        f" (checks not made: {reasons})" if reasons else ""
    )
    rate = counts["merge_rate"]
    merged = f"{counts['merged']} / {counts['split']}" + (
        f" ({rate:.0%})" if rate is not None else ""
    )
    return [*head, rollouts, str(counts["calls"]), str(counts["audited"]),
            str(counts["identical"]), _cell(diverging), not_checkable, merged]  # fmt: skip


HEADER = [
    "framework", "sample", "rollouts", "calls", "audited", "identical",
    "diverging: checks by cause; an example of the first cause, decoded token by token "
    "(…before⟦expected ≠ recorded⟧)",
    "not checkable (by reason)", "continuations merged / split",
]  # fmt: skip


def table(entries: Sequence[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row_of(e)) + " |" for e in entries]
    return "\n".join(lines)


def agents_table(entries: Sequence[dict[str, Any]]) -> str:
    """Per agent, for the runs with more than one agent."""
    lines = [
        "| sample | agent | calls | identical | diverging | merged / split |",
        "|---|---|---:|---:|---:|---|",
    ]
    for e in entries:
        agents = (e.get("json") or {}).get("agents") or {}
        if len(agents) < 2:
            continue
        for name, c in agents.items():
            cells = [BY_KEY[e["key"]].sample, name or "-", c["calls"], c["identical"]]
            cells += [c["diverging"], f"{c['merged']} / {c['split']}"]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


# ---- main ---------------------------------------------------------------------------------------
def audit_entry(
    spec: Spec,
    ctx: Ctx,
    name: str,
    label: str,
    logs: Path,
    timeout: float,
    tok: Any,
    ran: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one sample (unless ``ran`` says how it ran before) and audit its run: the entry
    for the table and the JSON."""
    if ran is None:
        print(f"[{time.strftime('%H:%M:%S')}] {spec.key} ({label}): {spec.sample}", flush=True)
        try:
            ran = run_sample(spec, ctx, name, logs / f"{name}.log", timeout)
        except Exception as exc:  # a sample that cannot even start: its row says why
            ran = {"rc": None, "seconds": 0.0, "error": f"{type(exc).__name__}: {exc}"}
    entry: dict[str, Any] = {**ran, "key": spec.key, "model_label": label, "run": name}
    if not (ctx.runs / name / "store.sqlite").exists():
        why = ran.get("error") or f"exit {ran['rc']}: " + " / ".join(ran.get("tail", []))
        entry["why"] = why
        print(f"  not run: {why}", flush=True)
        return entry
    result = asyncio.run(audit(ctx.runs / name, ctx.tokenizer))
    (logs.parent / f"{name}.audit.txt").write_text(result["text"])
    entry["json"] = result["json"]
    entry["summary"] = result["json"]["summary"]
    entry["statuses"] = dict(Counter(r.status for r, _ in result["audit"].rollouts))
    entry["analysis"] = analyse(result, tok)
    if spec.key == "planted":
        entry["planted"] = planted_check(result, tok)
    s = entry["summary"]
    print(f"  {ran['seconds']:.0f} s; {s['calls']} calls: {s['identical']} identical, "
          f"{s['diverging']} diverging, merged {s['merged']} / split {s['split']}; "
          f"causes {entry['analysis']['causes']}", flush=True)  # fmt: skip
    return entry


@vl.rollout
async def _no_agent(task: dict[str, Any], llm: vl.LLM) -> float:
    """SFT alone runs no rollout; the trainer still takes an agent."""
    return 0.0


def warm_up(args: argparse.Namespace, ctx: Ctx, logs: Path, specs: Sequence[Spec]) -> Path:
    """Record each tool sample's scripted teacher through its framework (no token ids, like a
    hosted API), then fine-tune SmolLM2 on them (``vl.SFT``, re-tokenized with its template)."""
    sources = []
    for spec in specs:
        name = f"teacher-{spec.key}"
        with serving(
            [str(SAMPLES / "teacher_server.py"), spec.sample], logs / f"{name}.serve.log"
        ) as url:
            c = dataclasses.replace(ctx, endpoint=url, model="teacher", tasks=args.teacher_tasks)
            teacher = dataclasses.replace(
                spec, command=lambda c, n, s=spec: [*s.command(c, n), "--no-token-ids"]
            )
            ran = run_sample(teacher, c, name, logs / f"{name}.log", args.timeout)
        print(f"  teacher of {spec.sample}: {ran['seconds']:.0f} s, exit {ran['rc']}", flush=True)
        if (ctx.runs / name / "store.sqlite").exists():
            sources.append(str(ctx.runs / name))
    sft = vl.SFT(
        model=MODEL, source=sources, retokenize=True, steps=args.warm_up_steps,
        batch_size=args.warm_up_batch, lr=3e-4, warmup_steps=1, threads=args.threads or 2,
    )  # fmt: skip
    shutil.rmtree(ctx.runs / "warm-up", ignore_errors=True)
    vl.Trainer(sft, run_dir=ctx.runs, name="warm-up").fit(_no_agent, [{"task": 0}])
    return ctx.runs / "warm-up" / "final"


def _stamp(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs", help="writes <out>/drift_audit")
    parser.add_argument("--tasks", type=int, default=6, help="rollouts a sample (werewolf: 1 game)")
    parser.add_argument("--max-tokens", type=int, default=48, help="per model call")
    parser.add_argument("--temperature", type=float, default=0.7, help="where the sample takes it")
    parser.add_argument("--only", nargs="*", choices=list(BY_KEY), help="these rows only")
    parser.add_argument("--threads", type=int, default=None, help="the engine's torch threads")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per sample run")
    parser.add_argument(
        "--warm-up-steps",
        type=int,
        default=0,
        help="also audit the tool samples on SmolLM2 fine-tuned this many steps on their "
        "teachers' rollouts (0: not)",
    )
    parser.add_argument("--warm-up-batch", type=int, default=4, help="rows per SFT step")
    parser.add_argument("--teacher-tasks", type=int, default=16, help="teacher rollouts a sample")
    parser.add_argument(
        "--tool-model", type=Path, default=None, help="a warmed model directory (no warm-up)"
    )
    parser.add_argument(
        "--reaudit",
        action="store_true",
        help="run nothing: audit the runs an earlier invocation left in <out>/drift_audit again",
    )
    args = parser.parse_args(argv)

    from voltrl.models.loading import load_tokenizer

    started = time.monotonic()
    out = args.out.resolve() / "drift_audit"
    logs, data, runs = out / "logs", out / "data", out / "runs"
    for d in (logs, data, runs):
        d.mkdir(parents=True, exist_ok=True)
    specs = [BY_KEY[k] for k in args.only] if args.only else SPECS
    tool_specs = [s for s in specs if s.uses_tools]
    tok = load_tokenizer(MODEL)
    threads = ["--threads", str(args.threads)] if args.threads else []
    serve = ["-m", "voltrl.cli", "model", "serve"]
    base = Ctx("", MODEL, runs, data, args.tasks, args.max_tokens, args.temperature, MODEL)
    if args.reaudit:
        before = json.loads((out / "results.json").read_text())
        entries = []
        for e in before["runs"]:
            if e["key"] in {s.key for s in specs}:
                ran = {k: e.get(k) for k in ("rc", "seconds", "cmd", "tail", "error")}
                warm = e["run"].endswith("-warm")
                model = str(runs / "warm-up" / "final") if warm else MODEL
                ctx = dataclasses.replace(base, tokenizer=model)
                entries.append(audit_entry(BY_KEY[e["key"]], ctx, e["run"], e["model_label"],
                                           logs, args.timeout, tok, ran=ran))  # fmt: skip
        minutes = before["minutes"]
    else:
        entries = []
        with serving([*serve, MODEL, *threads], logs / "serve.log") as url:
            ctx = dataclasses.replace(base, endpoint=url)
            for spec in specs:
                name = f"drift-{spec.key}"
                entries.append(audit_entry(spec, ctx, name, "SmolLM2", logs, args.timeout, tok))
        warmed = args.tool_model
        if warmed is None and args.warm_up_steps and tool_specs:
            _stamp(f"warm-up: the teachers' rollouts, then {args.warm_up_steps} SFT steps")
            warmed = warm_up(args, ctx, logs, [s for s in tool_specs if s.teacher])
        if warmed is not None and tool_specs:
            label = f"SmolLM2 + {args.warm_up_steps}-step tool warm-up"
            label = label if args.tool_model is None else warmed.name
            warm = [*serve, str(warmed), "--served-name", "smollm2-warm", *threads]
            with serving(warm, logs / "serve-warm.log") as url:
                ctx = dataclasses.replace(base, endpoint=url, model="smollm2-warm")
                ctx.tokenizer = str(warmed)
                for spec in tool_specs:
                    name = f"drift-{spec.key}-warm"
                    entries.append(audit_entry(spec, ctx, name, label, logs, args.timeout, tok))
        minutes = (time.monotonic() - started) / 60
    md = [
        f"Token-drift audit per framework: {MODEL} served by `voltrl model serve`, every call "
        f"through the gateway; up to {args.tasks} rollouts a sample, at most {args.max_tokens} "
        f"tokens a call, temperature {args.temperature} where the sample takes one; "
        f"{minutes:.1f} minutes.",
        "",
        table(entries),
    ]
    if agents := agents_table(entries):
        md += ["", "Per agent (multi-agent samples):", "", agents]
    notes = [
        f"- {BY_KEY[e['key']].sample}: {BY_KEY[e['key']].note}"
        for e in entries
        if BY_KEY[e["key"]].note and e["model_label"] == "SmolLM2"
    ]
    if notes:
        md += ["", "Settings:", "", *notes]
    text = "\n".join(md) + "\n"
    print(text)
    (out / "table.md").write_text(text)
    results = {"minutes": minutes, "args": vars(args), "runs": entries}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {out / 'table.md'} and results.json ({minutes:.1f} minutes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
