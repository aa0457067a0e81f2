"""``voltrl show``: one run, or one rollout of it, in the terminal.

``voltrl show RUN``: the run's summary, its rollouts by mode with reward statistics, and every
numeric metric of its ``metrics.jsonl`` as a sparkline (without that file, for a store server
say, the reward curve per resources version, from the store). ``voltrl show RUN ROLLOUT_ID``:
one rollout's task, attempts, LLM calls as a conversation, rewards and spans.

What is shown is loaded by :mod:`.run_views` (:func:`~.run_views.find_run`,
:func:`~.run_views.load_run`, :func:`~.run_views.load_rollout`); this module renders it onto a
rich console (:func:`render_run`, :func:`render_rollout`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from voltrl._console import printable
from voltrl._redact import shown
from voltrl.observability import prompt_search
from voltrl.observability.failures import agent_frames, traceback_frames
from voltrl.observability.metrics import (
    format_stats_table,
    metric_series,
    outcome_of,
    summarize,
    summary_rows,
)
from voltrl.observability.prompt_search import PromptSearch
from voltrl.observability.run_views import (
    RolloutView,
    RunView,
    find_run,
    load_rollout,
    load_run,
)
from voltrl.store.browse import counts_of
from voltrl.types import LLMCall, Rollout, Span

BARS = "▁▂▃▄▅▆▇█"
ROLES = {"system": "magenta", "user": "green", "assistant": "cyan", "tool": "yellow"}
GOOD = {"succeeded": "green", "finished": "green", "running": "blue", "queued": "blue"}
KEY_CONFIG = (
    "model",
    "schedule.steps",
    "schedule.tasks_per_step",
    "schedule.group_size",
    "steps",  # a run of VoltRL 0.1's LocalRL, or SFT's or APO's
    "tasks_per_step",
    "group_size",
    "n_repeats",
    "update.lr",
    "lr",
)
MAX_SPANS = 80
_CANDIDATE = {"kept": "green", "pending": "blue", "dropped": "", "rejected": "red", "failed": "red"}


def sparkline(values: Iterable[float], width: int = 60) -> str:
    """``values`` as ``▁▂▃▄▅▆▇█``, averaged into at most ``width`` buckets."""
    vals = [v for v in values if math.isfinite(v)]
    if len(vals) > width:
        edges = [round(i * len(vals) / width) for i in range(width + 1)]
        vals = [sum(vals[a:b]) / (b - a) for a, b in itertools.pairwise(edges) if b > a]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    if hi == lo:
        return BARS[3] * len(vals)
    return "".join(BARS[round((v - lo) / (hi - lo) * (len(BARS) - 1))] for v in vals)


def reward_curve(rollouts: Iterable[Rollout]) -> dict[str, list[tuple[int | None, float]]]:
    """Per mode, the mean reward of succeeded rollouts per resources version, in order."""
    groups: dict[str, dict[int | None, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rollouts:
        if r.status == "succeeded" and r.reward is not None:
            groups[r.mode][r.resources_version].append(r.reward)
    return {
        mode: [(v, sum(xs) / len(xs)) for v, xs in sorted(by.items(), key=lambda i: i[0] or 0)]
        for mode, by in groups.items()
    }


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if isinstance(x, int) or abs(x) >= 1e4 else f"{x:.4g}"


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s * 1000:.0f}ms" if s < 1 else f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    return f"{m}m{sec:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


def _status(status: str) -> Text:
    return Text(status, style=GOOD.get(status, "red"))


def _fold(text: str, full: bool, lines: int = 12, chars: int = 800, style: str = "") -> Text:
    """``text``, its middle folded away when longer than ``lines`` lines or ``chars``; text
    of whitespace alone is shown as what it is."""
    if text and not text.strip():
        return Text(f"(whitespace only: {text!r})", style="dim")
    split = text.splitlines()
    if full or (len(text) <= chars and len(split) <= lines):
        return Text(text, style=style)
    head = "\n".join(split[: max(1, lines * 2 // 3)])[: chars * 2 // 3]
    tail = "\n".join(split[-(lines // 4) :])[-(chars // 4) :] if lines >= 4 else ""
    out = Text(head, style=style)
    out.append(f"\n… {len(text) - len(head) - len(tail):,} characters folded …\n", style="dim")
    return out.append(tail, style=style)


def _table(title: str | Text | None, *columns: str, **options: Any) -> Table:
    table = Table(title=title, **options)
    for col in columns:
        table.add_column(col, overflow="fold")
    return table


def _fields(*rows: tuple[str, Any]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    for name, value in rows:
        if value not in (None, ""):
            grid.add_row(name, value)
    return grid


def _config(config: dict[str, Any], full: bool) -> str:
    """The key settings first (``model``, ``steps``...), only the first ten unless ``full``;
    secrets hidden (a run recorded before they were left out may hold one)."""
    config = shown(config)
    flat = {k: v for k, v in config.items() if not isinstance(v, dict)}
    for key, value in ((k, v) for k, v in config.items() if isinstance(v, dict)):
        flat.update({f"{key}.{k}": v for k, v in value.items()})
    keys = [k for k in KEY_CONFIG if k in flat] + [k for k in flat if k not in KEY_CONFIG]
    items = [f"{k}={json.dumps(v, default=str)}" for k in keys if (v := flat[k]) is not None]
    more = f"  (+{len(items) - 10} more: --full)" if len(items) > 10 and not full else ""
    return "  ".join(items if full else items[:10]) + more


def render_run(view: RunView, console: Console, *, full: bool = False) -> None:
    """Print a run: summary, rollouts by mode, metrics as sparklines, its latest rollouts."""
    run, rollouts = view.found.run, view.rollouts
    if view.found.note:
        console.print(Text(view.found.note, style="yellow"))
    console.print(Text.assemble(("run ", "bold"), (run.name, "bold cyan"), f"  {run.run_id}"))
    end = run.finished_at or (time.time() if run.status == "running" else None)
    console.print(
        _fields(
            ("status", _status(run.status)),
            ("kind", Text(f"{run.kind} · algorithm {run.algorithm or '-'}")),
            ("started", _when(run.created_at)),
            ("duration", end and _duration(end - run.created_at)),
            ("error", run.error and Text(run.error, style="red")),
            ("config", Text(_config(run.config, full))),
            ("store", Text(view.found.where)),
        )
    )
    stats = summary_rows(rollouts)
    if len({r.mode for r in rollouts}) > 1:
        stats["all"] = summarize(rollouts)
    console.print(format_stats_table("rollouts", stats) if stats else "no rollouts")
    if (outcome := outcome_of(run, counts_of(rollouts))) is not None:
        console.print(Text(outcome.line()), soft_wrap=True)
    columns = ("metric", "curve", "first → last", "min", "max", "over")
    table = _table(None, *columns, box=None, pad_edge=False)
    for column in table.columns[1:]:
        column.no_wrap = True
    if view.metrics:
        series = {name: values for name, _, values in metric_series(view.metrics)}
        width = max(8, min(60, console.width - max(map(len, series), default=0) - 50))
        points = {k: (sparkline(v, width), v, f"{len(v)} steps") for k, v in series.items()}
        console.print(Text(f"\nmetrics ({view.metrics_path})", style="bold"))
    else:
        points = {}
        for mode, curve in reward_curve(rollouts).items():
            values = [v for _, v in curve]
            span = f"versions {curve[0][0]}…{curve[-1][0]}"
            points[f"{mode} reward by resources version"] = (sparkline(values, 40), values, span)
        console.print(Text("\nreward curve (from the store)", style="bold"))
    for key, (line, values, count) in points.items():
        ends = f"{_num(values[0])} → {_num(values[-1])}"
        table.add_row(Text(key), line, ends, _num(min(values)), _num(max(values)), count)
    console.print(table if points else Text("no rewarded rollouts", style="dim"))
    if not view.metrics:
        note = "no metrics.jsonl here: other metrics (loss, KL, ...) are in the run directory: "
        note += f"{run.name}/metrics.jsonl"
        if view.metrics_path:
            note = f"no other metrics yet: {view.metrics_path} has no lines of this run"
        console.print(Text(note, style="dim"))
    if view.search is not None:
        _render_search(view.search, console, full)
    failed = [r for r in rollouts if r.status == "failed"][-3:]
    if latest := failed + [r for r in rollouts[-5:] if r not in failed]:
        asked = view.found.asked or run.name
        title = Text(f"latest rollouts (voltrl show {asked} ROLLOUT_ID shows one)")
        table = _table(title, "rollout", "mode", "status", "reward", "attempts", "error")
        for r in latest:
            cells = (_status(r.status), _num(r.reward), str(r.attempt_count), Text(r.error or ""))
            table.add_row(r.rollout_id, r.mode, *cells)
        console.print(table)
        if len(latest) < len(rollouts):
            shown = f"{len(latest)} of the run's {len(rollouts)} rollouts shown"
            console.print(Text(f"{shown}: voltrl dashboard lists them all", style="dim"))


def _render_search(search: PromptSearch, console: Console, full: bool) -> None:
    """An APO run's candidates by round, and the diff from the starting template to the best."""
    title = Text(
        f"\nprompt search ({prompt_search.FILE}): {search.rounds_done} round(s), "
        f"{search.stopped or 'running'}",
        style="bold",
    )
    table = _table(title, "round", "version", "parent", "score", "status", "template or reason")
    for c in search.candidates:
        shown = c.reason if c.status in ("rejected", "failed") else c.template
        cell = _fold(shown or "", full, lines=3, chars=160)
        if c.repaired:  # after the fold: never folded away
            cell.append(f"\nrepaired: {c.repaired}", style="dim")
        best = c.version is not None and c.version == search.best_version
        table.add_row(
            str(c.round),
            f"v{c.version}" if c.version is not None else "-",
            f"v{c.parent}" if c.parent is not None else "-",
            _num(c.score),
            Text(c.status + (" (best)" if best else ""), style=_CANDIDATE[c.status]),
            cell,
        )
    console.print(table)
    best = search.best
    if best is None or best is search.start:
        console.print(Text("no template beat the start", style="dim"))
        return
    console.print(Text(f"start → best (v{best.version}, round {best.round})", style="bold"))
    for line in prompt_search.template_diff(search.start.template, best.template):
        style = "green" if line.startswith("+") else "red" if line.startswith("-") else "dim"
        console.print(Text(line, style=style))


def _text(content: Any) -> str:
    """A message's content as text (of a list of parts: the text parts, others by type)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "\n".join(
            p.get("text", "") if p.get("type") == "text" else f"[{p.get('type')}]"
            for p in content
            if isinstance(p, dict)
        )
    return json.dumps(content, default=str)


def _tool_calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    calls = [tc.get("function") or {} for tc in message.get("tool_calls") or []]
    return [(str(f.get("name", "?")), _text(f.get("arguments"))) for f in calls]


def _key(message: Any) -> str:
    """What a message and its repetition in a later call's history have in common."""
    if not isinstance(message, dict):
        return repr(message)
    role, content = message.get("role"), _text(message.get("content"))
    return json.dumps([role, content, _tool_calls(message), message.get("tool_call_id")])


def _message(message: Any, names: dict[str, str], full: bool, reply: bool = False) -> list[Text]:
    """A message's row: its role, coloured, and its content, tool calls and reasoning."""
    if not isinstance(message, dict):
        return [Text("?"), Text(repr(message))]
    role = str(message.get("role", "?"))
    body = Text()
    if role == "tool":
        name = message.get("name") or names.get(str(message.get("tool_call_id")), "")
        body.append(f"{name} ⇒ " if name else "", style="dim")
        body.append_text(_fold(_text(message.get("content")), full, lines=4, chars=300))
    else:
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            body.append_text(_fold(f"thinking: {reasoning}", full, 4, 300, "dim italic"))
        if text := _text(message.get("content")):
            body.append("\n" if body.plain else "").append_text(_fold(text, full))
        for name, args in _tool_calls(message):
            body.append("\n" if body.plain else "").append("tool call ", style="dim")
            body.append(name, style="bold").append("(")
            body.append_text(_fold(args, full, lines=4, chars=300)).append(")")
    style = ROLES.get(role, "white") + (" bold" if reply else "")
    return [Text(f"→ {role}" if reply else role, style=style), body]


def _render_calls(calls: list[LLMCall], index: dict[str, int], console: Console, full: bool):
    """Each call as a conversation; the history a call repeats from the call before it (of
    the same attempt and agent) folded unless ``full``."""
    previous: dict[tuple[str, str | None], tuple[int, list[str]]] = {}
    for n, call in enumerate(calls, 1):
        prompt, response = call.prompt_token_ids or [], call.response_token_ids or []
        tokens = f"{len(prompt)} prompt + {len(response)} response tokens"
        head = [f"call {n}/{len(calls)}", f"attempt #{index.get(call.attempt_id, '?')}"]
        head += [call.agent_name or "(no agent name)", call.model or "-"]
        head += [f"finish {call.finish_reason}", _duration(call.latency_s)]
        head.append(tokens if call.has_token_ids else "no token ids")
        console.rule(Text(" · ".join(head), style="bold"), align="left", style="dim")
        grid = _fields()
        tools = [
            t.get("function") or t for t in call.request.get("tools") or [] if isinstance(t, dict)
        ]
        if names := ", ".join(str(t.get("name", "?")) for t in tools if isinstance(t, dict)):
            grid.add_row(Text("tools", style="dim"), Text(names, style="dim"))
        messages, ids, keys = call.request.get("messages"), {}, []
        if isinstance(messages, list):
            for m in messages:
                for tc in (m.get("tool_calls") or []) if isinstance(m, dict) else []:
                    ids[str(tc.get("id"))] = (tc.get("function") or {}).get("name", "")
            keys, start = [_key(m) for m in messages], 0
            if not full and (prev := previous.get((call.attempt_id, call.agent_name))):
                while start < min(len(keys), len(prev[1])) and keys[start] == prev[1][start]:
                    start += 1
                if start >= 2:
                    folded = f"{start} earlier messages, as in call {prev[0]} (--full shows them)"
                    grid.add_row(Text("…", style="dim"), Text(folded, style="dim"))
            for m in messages[start if start >= 2 else 0 :]:
                grid.add_row(*_message(m, ids, full))
        elif "prompt" in call.request:
            grid.add_row(Text("prompt", style="green"), _fold(_text(call.request["prompt"]), full))
        choice = (call.response.get("choices") or [{}])[0]
        if isinstance(choice.get("message"), dict):
            grid.add_row(*_message(choice["message"], ids, full, reply=True))
            previous[(call.attempt_id, call.agent_name)] = (n, [*keys, _key(choice["message"])])
        else:
            text = _text(choice.get("text"))
            grid.add_row(Text("→ completion", style="bold cyan"), _fold(text, full))
        console.print(grid)


def _span_tree(spans: list[Span], index: dict[str, int], full: bool) -> Tree:
    """The spans by parent (per attempt when several have some), with their durations."""
    tree = Tree(Text(f"spans ({len(spans)})", style="bold"))
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[Span]] = defaultdict(list)
    for s in sorted(spans, key=lambda s: s.start_time):
        children[s.parent_id if s.parent_id in ids and s.parent_id != s.span_id else None].append(s)
    shown: set[str] = set()
    limit = len(spans) if full else MAX_SPANS

    def add(node: Tree, parent: str | None, attempt: str) -> None:
        for s in children[parent]:
            if s.attempt_id != attempt or s.span_id in shown or len(shown) >= limit:
                continue
            shown.add(s.span_id)
            took = None if s.end_time is None else s.end_time - s.start_time
            label = Text.assemble(s.name, ("  " + _duration(took), "dim"))
            label.append("  error" if s.status == "error" else "", style="red")
            add(node.add(label), s.span_id, attempt)

    attempts = sorted({s.attempt_id for s in spans}, key=lambda a: index.get(a, 0))
    for attempt in attempts:
        node = tree.add(f"attempt #{index.get(attempt, '?')}") if len(attempts) > 1 else tree
        add(node, None, attempt)
    if len(shown) < len(spans):
        tree.add(Text(f"… {len(spans) - len(shown)} more spans (--full shows them)", style="dim"))
    return tree


def render_rollout(view: RolloutView, console: Console, *, full: bool = False) -> None:
    """Print a rollout: task, attempts (errors and tracebacks), LLM calls, rewards, spans."""
    r, run = view.rollout, view.found.run
    if view.found.note:
        console.print(Text(view.found.note, style="yellow"))
    console.print(
        Text.assemble(("rollout ", "bold"), (r.rollout_id, "bold cyan"), f"  of run {run.name}")
    )
    task = json.dumps(r.task.input, ensure_ascii=False, default=str)
    ran = None if r.started_at is None or r.finished_at is None else r.finished_at - r.started_at
    console.print(
        _fields(
            ("task", Text.assemble(_fold(task, full), (f"  ({r.task.task_id})", "dim"))),
            ("mode", r.mode),
            ("status", _status(r.status)),
            ("reward", _num(r.reward)),
            (
                "resources",
                None if r.resources_version is None else f"version {r.resources_version}",
            ),
            ("created", f"{_when(r.created_at)} · ran {_duration(ran)}"),
            ("error", r.error and Text(r.error, style="red")),
            ("run", Text(f"{run.name} ({run.run_id}) in {view.found.where}")),
        )
    )
    index = {a.attempt_id: a.index for a in view.attempts}
    title = f"attempts ({r.attempt_count} of at most {r.max_attempts})"
    table = _table(title, "#", "attempt", "worker", "status", "duration", "reward", "error")
    for a in view.attempts:
        took = None if a.finished_at is None else a.finished_at - a.started_at
        cells = (_status(a.status), _duration(took), _num(a.reward), Text(a.error or ""))
        table.add_row(str(a.index), a.attempt_id, Text(a.worker_id), *cells)
    console.print(table)
    for a in (a for a in view.attempts if a.traceback):
        console.print(Text(f"traceback of attempt #{a.index}:", style="bold red"))
        frames = traceback_frames(a.traceback or "")
        if full or not frames:
            console.print(_fold(a.traceback or "", full, lines=30, chars=4000, style="dim"))
            continue
        shown = agent_frames(frames)  # the agent's own, as the trainer's console has them
        console.print(Text("\n".join(f.text for f in shown) + f"\n{a.error}", style="dim"))
        if hidden := len(frames) - len(shown):
            note = "voltrl, the standard library and installed packages hidden: --full shows them"
            console.print(f"  ({hidden} frames of {note})", style="dim")
    console.print(Text(f"\nLLM calls ({len(view.calls)})", style="bold"))
    _render_calls(view.calls, index, console, full)
    columns = ("value", "name", "source", "step", "agents", "attempt")
    table = _table(f"rewards ({len(view.rewards)})", *columns)
    for w in view.rewards:
        agents = str(w.metadata["agents"]) if "agents" in w.metadata else ""
        cells = (w.source, _num(w.step), Text(agents), f"#{index.get(w.attempt_id, '?')}")
        table.add_row(_num(w.value), Text(w.name), *cells)
    if view.rewards:
        console.print(table)
    elif r.reward is None:
        console.print("no rewards")
    else:  # no reward records: the rollout returned its reward
        console.print(f"no rewards emitted (the rollout returned its reward, {_num(r.reward)})")
    console.print(_span_tree(view.spans, index, full) if view.spans else "no spans")


def show(
    run: str,
    rollout_id: str | None = None,
    *,
    store: str | None = None,
    run_dir: str | Path = "runs",
    token: str | None = None,
    full: bool = False,
    console: Console | None = None,
) -> int:
    """``voltrl show``: print the run (or one of its rollouts) found in ``store``, else in
    the stores of ``run_dir``; returns the exit status. Raises :class:`VoltRLError` for a
    run or rollout that is not there."""

    async def load() -> RunView | RolloutView:
        found = await find_run(run, store=store, run_dir=run_dir, token=token)
        try:
            if rollout_id is None:
                return await load_run(found, run_dir)
            return await load_rollout(found, rollout_id)
        finally:
            await found.store.close()

    view = printable(asyncio.run(load()))
    console = console or Console(highlight=False, markup=False)
    if isinstance(view, RunView):
        render_run(view, console, full=full)
    else:
        render_rollout(view, console, full=full)
    return 0
