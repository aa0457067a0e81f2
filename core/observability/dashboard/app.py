"""The dashboard's web app: server-rendered pages over :mod:`voltrl.observability.dashboard.data`.

Pages (under the mount point, ``/`` for ``voltrl dashboard``, ``/ui`` in ``voltrl serve``):

===========================  ==============================================================
``/``                        runs: status, steps, reward, duration; pick two to compare
``/runs/{run_id}``           a run: a chart per metric, its token-drift audit (fetched once
                             the page has loaded: :mod:`.audit_part`), rollouts per version
``/compare?run=A&run=B``     two runs' metrics on shared charts
``/rollouts``                rollouts: filters, sorting and pages answered by the store; a
                             filter on recorded events' fields (:mod:`.event_filter`)
``/rollouts/{rollout_id}``   a rollout: its outcome, its calls as one conversation, its
                             training rows; token views and spans when opened
                             (:mod:`.rollout_page`)
``/group``                   a GRPO group (run, task, resources version) side by side
``/workers``                 running attempts: claims, heartbeats, leases
``/api/runs/{run_id}``       a run's metric series as JSON (the charts poll it while it runs)
``/login``, ``/logout``      sign in with the token (a session cookie), sign out
===========================  ==============================================================

Charts are uPlot and live updates htmx (both vendored under ``static/vendor``: the dashboard
works offline). A page of a run that is still running refreshes its tables every few seconds
and its charts poll the JSON series; nothing reloads.

With a token, every page but sign-in needs a session (:mod:`.sessions`) or an
``Authorization: Bearer`` header; a visitor who has neither learns nothing about the server,
not even from an error page.
"""

from __future__ import annotations

import hmac
import json
import math
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from voltrl._redact import shown
from voltrl.errors import NotFoundError, StoreError
from voltrl.observability import prompt_search
from voltrl.observability.dashboard import conversation, data, training_rows
from voltrl.observability.dashboard.audit_part import add_audit_part
from voltrl.observability.dashboard.event_filter import filter_by_events, parse
from voltrl.observability.dashboard.rollout_page import add_rollout_pages
from voltrl.observability.dashboard.sessions import DEFAULT_SESSION_S, SESSION_COOKIE, Sessions
from voltrl.observability.metrics import (
    FIRST_METRICS,
    METRIC_NOTES,
    VAL_VERSION,
    Series,
    metric_series,
    outcome_of,
)
from voltrl.store.browse import RolloutPage, RolloutQuery, duration
from voltrl.trajectory.audit import percent

HERE = Path(__file__).resolve().parent
REFRESH_S = 3
"""How often a live page's tables poll, unless the dashboard is told otherwise."""
FINISHED_COUNTS_KEPT = 256
"""Finished runs whose rollout counts the dashboard keeps in memory (the least recently shown
go first): a dashboard left open for months over a busy store stays bounded."""
STORE_CURVES = tuple(f"store/{mode}_reward_by_version" for mode in ("train", "val", "dev"))
"""The reward curves drawn from the store where no metrics.jsonl is known."""


def dashboard_app(
    catalog: data.Catalog,
    *,
    token: str | None = None,
    session_s: float = DEFAULT_SESSION_S,
    refresh_s: float = REFRESH_S,
) -> FastAPI:
    """The dashboard over ``catalog``'s stores. With a ``token``, pages need the session
    cookie that ``/login`` sets once given the token, good for ``session_s`` seconds or until
    ``/logout`` (or an ``Authorization: Bearer`` header with the token). Live tables poll
    every ``refresh_s`` seconds (tests make it long, and refresh a table when they choose)."""
    app = FastAPI(title="VoltRL dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    sessions = Sessions(token, session_s) if token else None
    templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.filters["ago"] = _ago
    templates.env.filters["seconds"] = _seconds
    templates.env.filters["num"] = _num
    templates.env.filters["percent"] = percent
    templates.env.filters["pretty"] = conversation.text_of
    templates.env.filters["shown"] = conversation.shown_value
    templates.env.filters["whole"] = conversation.whole_value
    templates.env.globals["REFRESH_S"] = refresh_s
    templates.env.globals["first_metrics"] = [*FIRST_METRICS, *STORE_CURVES]
    templates.env.globals["metric_notes"] = METRIC_NOTES
    templates.env.globals["url_for"] = _url_path
    templates.env.globals["session_s"] = session_s
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    # a finished run's counts never change: the latest FINISHED_COUNTS_KEPT stay in memory
    counts_of_finished: OrderedDict[str, list[Any]] = OrderedDict()
    app.state.finished_counts = counts_of_finished

    def signed_in(request: Request) -> bool:
        """Whether the request may see the dashboard: no token, or a session or the token."""
        if sessions is None or token is None:
            return True
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            return hmac.compare_digest(header[7:].strip().encode(), token.encode())
        return sessions.valid(request.cookies.get(SESSION_COOKIE, ""))

    def page(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        shown = signed_in(request)
        context.setdefault("sources", catalog.describe() if shown else "")
        context["signed_in"] = shown
        context["sign_out"] = sessions is not None and shown
        context["here"] = _here(request)
        return templates.TemplateResponse(request, name, context, status_code=status)

    def error(request: Request, status: int, title: str, message: str) -> HTMLResponse:
        """An error page; a visitor not signed in gets only its title (nothing about the
        server: no paths, no store)."""
        if not signed_in(request):
            title, message = ("Not found" if status == 404 else f"Error {status}"), ""
        return page(request, "error.html", status, title=title, message=message)

    async def counts(entry: data.RunEntry) -> list[Any]:
        run_id = entry.run.run_id
        if run_id in counts_of_finished:
            counts_of_finished.move_to_end(run_id)
            return counts_of_finished[run_id]
        found = await entry.store.rollout_counts(run_id)
        if entry.run.status != "running":
            counts_of_finished[run_id] = found
            if len(counts_of_finished) > FINISHED_COUNTS_KEPT:
                counts_of_finished.popitem(last=False)  # the least recently shown
        return found

    if sessions is not None:

        @app.middleware("http")
        async def require_session(request: Request, call_next: Any) -> Response:
            path = request.url.path.removeprefix(request.scope.get("root_path", ""))
            if path in ("/login", "/logout") or path.startswith("/static/") or signed_in(request):
                return await call_next(request)
            if request.method == "GET" and not path.startswith("/api/"):
                login_page = request.url_for("login").path
                return RedirectResponse(f"{login_page}?{urlencode({'next': _here(request)})}")
            return JSONResponse({"error": "missing or wrong token"}, status_code=401)

    @app.get("/login", response_class=HTMLResponse, name="login")
    async def login_form(request: Request, next: str = "") -> HTMLResponse:
        return page(request, "login.html", next=next, wrong=False)

    @app.post("/login", response_class=HTMLResponse)
    async def login(request: Request) -> Response:
        form = parse_qs((await request.body()).decode(errors="replace"))
        given = (form.get("token") or [""])[0]
        target = (form.get("next") or [""])[0]
        home = request.url_for("runs").path
        if not target.startswith("/") or target.startswith("//") or "\\" in target:
            target = home  # only a page of this site: no redirect elsewhere after sign-in
        if not token or not sessions or not hmac.compare_digest(given.encode(), token.encode()):
            return page(request, "login.html", 401, next=target, wrong=True)
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            SESSION_COOKIE,
            sessions.start(),
            max_age=math.ceil(sessions.lifetime_s),
            path=home,  # the dashboard's pages only (under voltrl serve: /ui/, not the gateway)
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    @app.post("/logout", name="logout")
    async def logout(request: Request) -> Response:
        if sessions is not None:
            sessions.end(request.cookies.get(SESSION_COOKIE, ""))
        response = RedirectResponse(request.url_for("login").path, status_code=303)
        response.delete_cookie(
            SESSION_COOKIE,
            path=request.url_for("runs").path,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    @app.exception_handler(NotFoundError)
    async def not_found(request: Request, exc: NotFoundError) -> HTMLResponse:
        return error(request, 404, "Not found", str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> HTMLResponse:
        title = "Not found" if exc.status_code == 404 else f"Error {exc.status_code}"
        return error(request, exc.status_code, title, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> HTMLResponse:
        return error(request, 400, "Bad request", "; ".join(_problem(e) for e in exc.errors()))

    @app.exception_handler(StoreError)
    async def store_error(request: Request, exc: StoreError) -> HTMLResponse:
        return error(request, 502, "The store did not answer", str(exc))

    @app.get("/", response_class=HTMLResponse, name="runs")
    async def runs(request: Request) -> HTMLResponse:
        entries = await catalog.runs()
        rows = []
        for entry in entries:
            async with catalog.hold():  # one run's store at a time: a long list opens few
                rows.append(_run_row(entry, await counts(entry)))
        live = any(e.run.status == "running" for e in entries)
        return page(request, "runs.html", rows=rows, live=live)

    @app.get("/runs/{run_id}", response_class=HTMLResponse)
    async def run(request: Request, run_id: str) -> HTMLResponse:
        entry = await catalog.run(run_id)
        found = await counts(entry)
        versions = _versions(found, data.read_metrics(entry))
        series = _series(entry, found)
        search = prompt_search.load(entry.run_dir) if entry.run_dir is not None else None
        diff = []
        if search is not None and search.best is not None and search.best is not search.start:
            diff = prompt_search.template_diff(search.start.template, search.best.template)
        return page(
            request,
            "run.html",
            entry=entry,
            row=_run_row(entry, found),
            versions=versions,
            series=series,
            search=search,
            diff=diff,
            config=json.dumps(shown(entry.run.config), indent=2, default=str),
            live=entry.run.status == "running",
        )

    @app.get("/api/runs/{run_id}")
    async def run_series(run_id: str) -> JSONResponse:
        entry = await catalog.run(run_id)
        series = _series(entry, await counts(entry))
        return JSONResponse({"status": entry.run.status, "series": series})

    @app.get("/compare", response_class=HTMLResponse)
    async def compare(request: Request) -> HTMLResponse:
        ids = request.query_params.getlist("run")
        if len(ids) < 2:
            return page(
                request,
                "error.html",
                400,
                title="Pick two runs",
                message="tick two runs on the runs page to compare them",
            )
        entries = [await catalog.run(i) for i in ids]
        series = [_series(e, await counts(e)) for e in entries]
        return page(request, "compare.html", entries=entries, series=series)

    @app.get("/rollouts", response_class=HTMLResponse)
    async def rollouts(request: Request) -> HTMLResponse:
        params = request.query_params
        try:
            query = _rollout_query(params)
            conditions = parse(params.get("event", ""))
        except ValidationError as e:
            message = "; ".join(_problem(err) for err in e.errors())
            return page(request, "error.html", 400, title="Bad filter", message=message)
        except ValueError as e:  # a page number that is not one, an event filter without =
            return page(request, "error.html", 400, title="Bad filter", message=str(e))
        entries = await catalog.runs()
        names = {e.run.run_id: e.run.name for e in entries}
        locations = catalog.locations
        if query.run_id is None and len(locations) > 1 and entries:  # a page is of one store
            query = query.model_copy(update={"run_id": entries[0].run.run_id})
        if query.run_id is not None:
            store = (await catalog.run(query.run_id)).store
        elif locations:
            store = catalog.store(locations[0])
        else:  # a directory with no run yet
            store = None
        found_page, scanned = RolloutPage(rollouts=[], total=0), None
        if store is not None and conditions:
            filtered = await filter_by_events(store, query, conditions)
            found_page = filtered.page
            scanned = filtered.scanned if filtered.stopped else None
        elif store is not None:
            found_page = await store.browse_rollouts(query)
        found, total, capped = found_page.rollouts, found_page.total, found_page.total_capped
        live = any(r.status in ("queued", "running") for r in found) or any(
            e.run.status == "running" for e in entries if query.run_id in (None, e.run.run_id)
        )
        return page(
            request,
            "rollouts.html",
            query=query,
            rollouts=found,
            total=total,
            capped=capped,
            scanned=scanned,
            event=params.get("event", ""),
            names=names,
            runs=entries,
            any_run=len(locations) == 1,
            live=live,
            link=_link(params),
            duration=duration,
        )

    add_rollout_pages(app, catalog, page)
    add_audit_part(app, catalog, page)

    @app.get("/group", response_class=HTMLResponse)
    async def group(
        request: Request, run_id: str, task_id: str, version: int | None = None
    ) -> HTMLResponse:
        entry = await catalog.run(run_id)
        query = RolloutQuery(
            run_id=run_id,
            mode="train",
            task_id=task_id,
            resources_version=version,
            sort="reward",
            limit=500,
        )
        members = (await entry.store.browse_rollouts(query)).rollouts
        if not members:
            raise NotFoundError(
                f"no train rollouts of task {task_id!r} at version {version} in run {run_id!r}"
            )
        finished = next((m for m in members if m.finished), None)
        step = (
            await training_rows.step_rows(entry, finished)
            if finished
            else training_rows.Step({}, {}, "")
        )
        cards = []
        for ro in members:
            calls = await entry.store.get_llm_calls(ro.rollout_id)
            rows = step.rows.get(ro.rollout_id, [])
            last = conversation.response_message(calls[-1]) if calls else {}
            cards.append(
                {
                    "ro": ro,
                    "calls": len(calls),
                    "tokens": sum(len(c.response_token_ids or []) for c in calls),
                    "advantages": [(r.agent, r.advantage) for r in rows],
                    "answer": conversation.text_of(
                        last.get("content") or "\n".join(conversation.tool_calls(last))
                    ),
                }
            )
        return page(
            request,
            "group.html",
            entry=entry,
            task_id=task_id,
            version=version,
            cards=cards,
            task=members[0].task,
            note=step.note,
        )

    @app.get("/workers", response_class=HTMLResponse)
    async def workers(request: Request) -> HTMLResponse:
        return page(request, "workers.html", workers=await data.workers(catalog), live=True)

    app.add_middleware(_HoldStores, catalog=catalog)
    return app


class _HoldStores:
    """ASGI middleware: the stores a request opens stay open until it is answered (the
    catalog closes idle ones between requests)."""

    def __init__(self, app: ASGIApp, catalog: data.Catalog) -> None:
        self.app = app
        self.catalog = catalog

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        async with self.catalog.hold():
            await self.app(scope, receive, send)


@jinja2.pass_context
def _url_path(context: Any, name: str, /, **params: Any) -> str:
    """``url_for`` for the templates, as a path (``/ui/rollouts``): links that work behind a
    proxy that serves the dashboard under another scheme or host."""
    return context["request"].url_for(name, **params).path


def _here(request: Request) -> str:
    """This page's path and query (what a live page polls, where sign-in returns to)."""
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


def _problem(error: Mapping[str, Any]) -> str:
    """One validation error as a reader wants it: ``reward_min: Input should be a number``."""
    where = ".".join(str(p) for p in error.get("loc", ()) if p not in ("query", "body"))
    return f"{where}: {error.get('msg', 'invalid')}" if where else str(error.get("msg"))


def _rollout_query(params: Any) -> RolloutQuery:
    """The store query of the rollouts page's filter form (empty fields do not filter)."""
    known = set(RolloutQuery.model_fields) | {"page"}
    fields = {k: v for k, v in params.items() if v != "" and k in known and k != "status"}
    fields["status"] = [s for s in params.getlist("status") if s]
    fields["descending"] = fields.get("descending", "true") not in ("false", "0")
    page_no = int(fields.pop("page", 1) or 1)
    limit = int(fields.get("limit", 50))
    fields["offset"] = max(0, page_no - 1) * limit
    return RolloutQuery(**fields)


def _link(params: Any) -> Any:
    """``link(key=value, ...)``: this page's query with some parameters changed."""

    def link(**changes: Any) -> str:
        items = [(k, v) for k, v in params.multi_items() if k not in changes]
        for key, value in changes.items():
            if value is not None:
                items.append((key, str(value).lower() if isinstance(value, bool) else value))
        return "?" + urlencode(items)

    return link


def _run_row(entry: data.RunEntry, counts: list[Any]) -> dict[str, Any]:
    """A run's line on the runs page."""
    train = [c for c in counts if c.mode == "train" and c.resources_version is not None]
    # A step stopped by an interrupt has its unfinished rollouts cancelled; a resumed run does
    # it again at a new version: it is one step, not two.
    stopped = {c.resources_version for c in train if c.status == "cancelled"}
    versions = {c.resources_version for c in train} - stopped
    by_status: dict[str, int] = {}
    for c in counts:
        by_status[c.status] = by_status.get(c.status, 0) + c.count
    end = entry.run.finished_at or (time.time() if entry.run.status == "running" else None)
    return {
        "entry": entry,
        "run": entry.run,
        "steps": len(versions),
        "by_status": by_status,
        "rollouts": sum(by_status.values()),
        "outcome": outcome_of(entry.run, counts),
        "duration": None if end is None else end - entry.run.created_at,
        "spark": _spark([c for c in counts if c.mode in ("train", "dev")], stopped),
    }


def _spark(counts: list[Any], stopped: set[int | None]) -> list[float]:
    """Mean reward per resources version (train or dev rollouts), for the runs table; not of
    the ``stopped`` versions (a step an interrupt cut short: its few finished rollouts are not
    the step's reward)."""
    per: dict[int, list[float]] = {}
    for c in counts:
        if c.rewarded and c.resources_version is not None and c.resources_version not in stopped:
            s = per.setdefault(c.resources_version, [0.0, 0.0])
            s[0] += c.reward_sum
            s[1] += c.rewarded
    return [per[v][0] / per[v][1] for v in sorted(per)]


def _versions(counts: list[Any], records: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """One line per resources version: rollouts per mode and status, mean rewards, and
    ``what`` it was in the run, from the run's ``metrics.jsonl`` ``records`` (LocalRL logs
    each step's ``resources_version`` and each validation's ``val/resources_version``): ``step
    N``, ``validation before training``, ``validation after step N``; ``interrupted step`` for
    training rollouts an interrupt cancelled (a resumed run does the step again at a new
    version); else nothing."""
    table: dict[int | None, dict[str, Any]] = {}
    for c in counts:
        row = table.setdefault(
            c.resources_version, {"version": c.resources_version, "status": {}, "modes": {}}
        )
        row["status"][c.status] = row["status"].get(c.status, 0) + c.count
        m = row["modes"].setdefault(c.mode, {"count": 0, "sum": 0.0, "rewarded": 0})
        m["count"] += c.count
        m["sum"] += c.reward_sum
        m["rewarded"] += c.rewarded
    what: dict[int, str] = {}
    for r in records:
        step = r.get("step")
        if isinstance(r.get(VAL_VERSION), int) and isinstance(step, int):
            where = f"validation after step {step}" if step else "validation before training"
            what[r[VAL_VERSION]] = where
        elif isinstance(r.get("resources_version"), int) and "batch/rows" in r:
            what[r["resources_version"]] = f"step {step}"
    for row in table.values():
        for m in row["modes"].values():
            m["mean"] = m["sum"] / m["rewarded"] if m["rewarded"] else None
        stopped = "train" in row["modes"] and "cancelled" in row["status"]
        row["what"] = what.get(row["version"], "interrupted step" if stopped else "")
    return sorted(table.values(), key=lambda r: (r["version"] is not None, r["version"] or 0))


def _series(entry: data.RunEntry, counts: list[Any]) -> Series:
    """The run's charts: every metric of ``metrics.jsonl``; without one, the mean reward per
    resources version and mode from the store."""
    series = metric_series(data.read_metrics(entry))
    names = {name for name, _, _ in series}
    for mode in ("train", "val", "dev"):
        rows = [r for r in _versions(counts) if r["version"] is not None and mode in r["modes"]]
        points = [(r["version"], r["modes"][mode]["mean"]) for r in rows]
        points = [(v, m) for v, m in points if m is not None]
        if points and f"{mode}/reward_mean" not in names:
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            series.append((f"store/{mode}_reward_by_version", xs, ys))  # STORE_CURVES
    return series


def _ago(t: float | None) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    return f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"
