"""The dashboard over HTTP: sign-in with a token, ``voltrl serve``'s ``/ui``, store URLs as
sources, clear answers to bad input. (Pages in a real browser: test_dashboard_browser.py.)"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from voltrl._http.serving import serve_in_thread
from voltrl.cli import main
from voltrl.cli.serve import server_app
from voltrl.errors import VoltRLError
from voltrl.observability.dashboard import Catalog, dashboard_app
from voltrl.store.http.endpoints import store_app
from voltrl.store.sql import SQLStore

TOKEN = "s3cret-dashboard-token"


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dashboard_run import make_run

    root = tmp_path_factory.mktemp("dashboard-http")
    make_run(root, steps=1)
    return root


@pytest.fixture
def client(runs_dir: Path) -> Iterator[httpx.Client]:
    with (
        serve_in_thread(dashboard_app(Catalog([runs_dir]), token=TOKEN)) as server,
        httpx.Client(base_url=server.url) as c,
    ):
        yield c


@pytest.mark.slow
def test_pages_need_the_token_and_sign_in_sets_a_cookie(client: httpx.Client) -> None:
    page = client.get("/rollouts", follow_redirects=True)
    assert page.status_code == 200 and "needs its token" in page.text  # the sign-in form
    assert page.url.path == "/login" and page.url.params["next"].endswith("/rollouts")
    assert client.get("/api/runs/x").status_code == 401
    wrong = client.post("/login", data={"token": "nope", "next": "/rollouts"})
    assert wrong.status_code == 401 and "not the one" in wrong.text
    signed = client.post("/login", data={"token": TOKEN, "next": "/rollouts"})
    assert signed.status_code == 303 and signed.headers["location"] == "/rollouts"
    cookie = signed.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    assert "rollout-row" in client.get("/rollouts").text
    assert TOKEN not in client.get("/").text  # never echoed into a page


def test_a_bearer_header_also_opens_the_pages(client: httpx.Client) -> None:
    page = client.get("/", headers={"Authorization": f"Bearer {TOKEN}"})
    assert page.status_code == 200 and "run-row" in page.text


def test_bad_input_gets_a_clear_answer(client: httpx.Client) -> None:
    client.post("/login", data={"token": TOKEN})
    bad = client.get("/rollouts?limit=100000")
    assert bad.status_code == 400 and "less than or equal to 500" in bad.text
    bad = client.get("/rollouts?reward_min=lots")
    assert bad.status_code == 400 and "reward_min" in bad.text
    missing = client.get("/rollouts/ro-nope")
    assert missing.status_code == 404 and "no rollout &#39;ro-nope&#39;" in missing.text
    assert client.get("/runs/run-nope").status_code == 404
    assert client.get("/compare?run=a").status_code == 400


def test_voltrl_serve_mounts_the_dashboard_under_ui_behind_its_token(runs_dir: Path) -> None:
    store = SQLStore(runs_dir / "dash" / "store.sqlite")
    try:
        with (
            serve_in_thread(server_app(store, token=TOKEN)) as server,
            httpx.Client(base_url=server.url) as c,
        ):
            assert c.get("/v1/store/runs").status_code == 401  # the API still needs it
            assert "needs its token" in c.get("/ui/", follow_redirects=True).text
            c.post("/ui/login", data={"token": TOKEN, "next": "/ui/"})
            page = c.get("/ui/")
            assert "run-row" in page.text and '/ui/rollouts"' in page.text
            assert c.get("/ui/static/dashboard.js").status_code == 200
            assert c.get("/v1/store/runs").status_code == 401  # the cookie opens only /ui
    finally:
        asyncio.run(store.close())


def test_a_store_server_url_is_a_source(runs_dir: Path) -> None:
    store = SQLStore(runs_dir / "dash" / "store.sqlite")
    try:
        with serve_in_thread(store_app(store, token=TOKEN)) as served:
            catalog = Catalog([served.url], token=TOKEN)
            with (
                serve_in_thread(dashboard_app(catalog)) as server,
                httpx.Client(base_url=server.url) as c,
            ):
                assert "run-row" in c.get("/").text
                rows = c.get("/rollouts?mode=train").text
                rollout = re.findall(r"/rollouts/(ro-[0-9a-f]+)", rows)[0]
                page = c.get(f"/rollouts/{rollout}").text
                assert "the run directory is unknown" in page and "#" in page
    finally:
        asyncio.run(store.close())


def test_a_source_that_is_not_a_store_is_refused(tmp_path: Path, capsys) -> None:
    with pytest.raises(VoltRLError, match="does not exist"):
        Catalog([tmp_path / "missing"])
    assert main(["dashboard", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_binding_beyond_loopback_needs_a_token(runs_dir: Path, capsys) -> None:
    assert main(["dashboard", str(runs_dir), "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "--token" in capsys.readouterr().err


def test_sign_in_returns_only_to_pages_of_this_site(client: httpx.Client) -> None:
    for elsewhere in ("https://evil.example/x", "//evil.example/x", "/\\evil.example"):
        answer = client.post("/login", data={"token": TOKEN, "next": elsewhere})
        assert answer.status_code == 303 and answer.headers["location"] == "/", elsewhere


def test_passwords_in_store_urls_are_never_shown(tmp_path: Path) -> None:
    catalog = Catalog(["http://user:hunter2@127.0.0.1:9/"])  # nothing listens there
    assert "hunter2" not in catalog.describe() and "***" in catalog.describe()
    with (
        serve_in_thread(dashboard_app(catalog, token=TOKEN)) as server,
        httpx.Client(base_url=server.url) as c,
    ):
        assert "hunter2" not in c.get("/login").text
        c.post("/login", data={"token": TOKEN})
        page = c.get("/")
        assert page.status_code == 502 and "hunter2" not in page.text  # the store is away


def test_workers_shows_running_attempts_with_their_leases() -> None:
    from voltrl.store.memory import InMemoryStore
    from voltrl.types import Task

    store = InMemoryStore()

    async def claimed() -> str:
        await store.enqueue([Task(input={"q": 1})])
        claim = await store.claim("runner-7", lease_s=30)
        assert claim is not None
        return claim.rollout.rollout_id

    rollout_id = asyncio.run(claimed())
    with (
        serve_in_thread(dashboard_app(Catalog([store]))) as server,
        httpx.Client(base_url=server.url) as c,
    ):
        page = c.get("/workers").text
    assert "runner-7" in page and rollout_id in page and "expired" not in page


def test_errors_are_pages_that_say_what_is_wrong(client: httpx.Client) -> None:
    client.post("/login", data={"token": TOKEN})
    bad = client.get("/rollouts?reward_min=lots")
    assert bad.status_code == 400 and "reward_min: Input should be a valid number" in bad.text
    assert "errors.pydantic.dev" not in bad.text
    missing = client.get("/nope")
    assert missing.status_code == 404 and "<h1>Not found</h1>" in missing.text
    no_task = client.get("/group?run_id=x")
    assert no_task.status_code == 400 and "task_id: Field required" in no_task.text
    past = client.get("/rollouts?page=999").text
    assert "page 999 is past the last one" in past


def test_only_train_rollouts_link_to_a_group(client: httpx.Client) -> None:
    client.post("/login", data={"token": TOKEN})
    assert "/group?" not in client.get("/rollouts?mode=val").text
    assert "/group?" in client.get("/rollouts?mode=train").text


def test_a_run_started_after_the_dashboard_is_found_by_rollout_id(
    runs_dir: Path, tmp_path: Path
) -> None:
    import shutil
    import sqlite3

    root = tmp_path / "later-runs"
    root.mkdir()
    with (
        serve_in_thread(dashboard_app(Catalog([root]))) as server,
        httpx.Client(base_url=server.url) as c,
    ):
        assert "No runs yet" in c.get("/").text
        assert "No rollouts match" in c.get("/rollouts").text  # an empty directory: no error
        shutil.copytree(runs_dir / "dash", root / "dash")  # a run appears
        with sqlite3.connect(root / "dash" / "store.sqlite") as db:
            (rollout_id,) = db.execute("SELECT rollout_id FROM rollouts LIMIT 1").fetchone()
        page = c.get(f"/rollouts/{rollout_id}")  # straight there, no listing first
        assert page.status_code == 200 and rollout_id in page.text


def test_advantages_of_a_run_with_lora_adapters_are_computed_per_adapter():
    """Each adapter's rows are normalised within its own GRPO groups, as LocalRL's update
    does; rows of no adapter get none (they are not trained)."""
    from voltrl.algorithms.local.update import PolicyUpdateConfig, batch_advantages
    from voltrl.observability.dashboard.training_rows import TrainingRow, _advantages
    from voltrl.trajectory import TrajectoryConfig, collate
    from voltrl.types import Run, Trajectory, Transition

    def row(agent: str, model: str, reward: float) -> Transition:
        return Transition(
            prompt_token_ids=[1], response_token_ids=[2], reward=reward, agent_name=agent,
            model=model,
        )  # fmt: skip

    built = [
        Trajectory(
            rollout_id=f"r{i}",
            task_id="t",
            transitions=[
                row("write", "writer", float(i)),
                row("check", "checker", float(i % 2)),
                row("judge", "voltrl-local", 1.0),
            ],
        )
        for i in range(4)
    ]
    config = {"update": {}, "lora_adapters": {"writer": "write", "checker": "check"}}
    run = Run(name="x", kind="fit", algorithm="local_rl", config=config)
    rows = {t.rollout_id: [TrainingRow([1], [2], [1], [None], 0, None, None) for _ in range(3)]
            for t in built}  # fmt: skip
    note = _advantages(run, TrajectoryConfig(), built, rows)
    assert "each LoRA adapter over its own rows" in note and "writer 4" in note
    batch = collate(built)
    for k in (0, 1):  # the writer's rows, then the checker's
        expected = batch_advantages(batch.select(range(k, 12, 3)), PolicyUpdateConfig()).tolist()
        assert [rows[f"r{i}"][k].advantage for i in range(4)] == expected
        assert expected != batch_advantages(batch, PolicyUpdateConfig()).tolist()[k::3]
    assert all(rows[f"r{i}"][2].advantage is None for i in range(4))
    writer = rows["r0"][0].group  # the numbers its tooltip explains the advantage with
    assert writer is not None and (writer.rows, writer.mean) == (4, 1.5)
    assert abs(writer.std - statistics.stdev([0.0, 1.0, 2.0, 3.0])) < 1e-9


# ---- sessions -----------------------------------------------------------------------------------
def sign_in(c: httpx.Client, prefix: str = "") -> str:
    """Sign in through the form; returns the session cookie's value."""
    answer = c.post(f"{prefix}/login", data={"token": TOKEN, "next": f"{prefix}/"})
    assert answer.status_code == 303, answer.text
    return answer.cookies["voltrl_session"]


def signed_out(c: httpx.Client, cookie: str, prefix: str = "") -> bool:
    """Whether a request with ``cookie`` as the session is sent to the sign-in page."""
    c.cookies.clear()
    c.cookies.set("voltrl_session", cookie)
    answer = c.get(f"{prefix}/")
    return answer.status_code == 307 and f"{prefix}/login?" in answer.headers["location"]


def test_the_session_cookie_is_signed_and_holds_no_token(client: httpx.Client) -> None:
    answer = client.post("/login", data={"token": TOKEN, "next": "/"})
    cookie = answer.cookies["voltrl_session"]
    header = answer.headers["set-cookie"].lower()
    assert TOKEN not in header and "httponly" in header and "samesite=strict" in header
    assert "path=/" in header and "max-age=43200" in header  # 12 hours
    assert not signed_out(client, cookie)
    expires, nonce, mac = cookie.split(".")
    assert signed_out(client, f"{int(expires) + 3_600_000}.{nonce}.{mac}")  # a longer life
    assert signed_out(client, f"{expires}.{nonce}.{'0' * len(mac)}")
    assert signed_out(client, "garbage") and signed_out(client, "")


def test_the_token_itself_opens_no_page_as_a_cookie(client: httpx.Client) -> None:
    for name in ("voltrl_token", "voltrl_session"):  # where it was kept before, and now
        client.cookies.clear()
        client.cookies.set(name, TOKEN)
        assert client.get("/").status_code == 307, name


def test_a_session_expires(runs_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the sessions' clock, which the test moves: good until its lifetime is past."""
    from voltrl.observability.dashboard import sessions

    now = [time.time()]
    monkeypatch.setattr(sessions, "time", SimpleNamespace(time=lambda: now[0]))
    app = dashboard_app(Catalog([runs_dir]), token=TOKEN, session_s=60.0)
    with serve_in_thread(app) as server, httpx.Client(base_url=server.url) as c:
        cookie = sign_in(c)
        assert not signed_out(c, cookie) and "run-row" in c.get("/").text
        now[0] += 59.0
        assert not signed_out(c, cookie)
        now[0] += 2.0
        assert signed_out(c, cookie)


def test_a_session_made_under_another_token_is_refused(runs_dir: Path) -> None:
    with (
        serve_in_thread(dashboard_app(Catalog([runs_dir]), token=TOKEN)) as first,
        httpx.Client(base_url=first.url) as c,
    ):
        cookie = sign_in(c)
    app = dashboard_app(Catalog([runs_dir]), token="a-new-token")
    with serve_in_thread(app) as second, httpx.Client(base_url=second.url) as c:
        assert signed_out(c, cookie)


def test_signing_out_ends_the_session(client: httpx.Client) -> None:
    cookie = sign_in(client)
    page = client.get("/").text
    assert 'action="/logout"' in page and "Sign out" in page
    answer = client.post("/logout")
    assert answer.status_code == 303 and answer.headers["location"] == "/login"
    assert 'voltrl_session=""' in answer.headers["set-cookie"]  # the browser forgets it
    assert "voltrl_session" not in client.cookies
    assert signed_out(client, cookie)  # and a copy of it no longer opens the pages


def test_voltrl_serve_signs_in_and_out_under_ui(runs_dir: Path) -> None:
    store = SQLStore(runs_dir / "dash" / "store.sqlite")
    try:
        with (
            serve_in_thread(server_app(store, token=TOKEN)) as server,
            httpx.Client(base_url=server.url) as c,
        ):
            answer = c.post("/ui/login", data={"token": TOKEN, "next": "/ui/"})
            assert "path=/ui/" in answer.headers["set-cookie"].lower()
            assert "run-row" in c.get("/ui/").text
            cookie = answer.cookies["voltrl_session"]
            assert c.post("/ui/logout").headers["location"] == "/ui/login"
            assert signed_out(c, cookie, "/ui")
    finally:
        asyncio.run(store.close())


# ---- what an anonymous visitor sees -------------------------------------------------------------
def test_an_anonymous_visitor_learns_nothing_about_the_server(runs_dir: Path) -> None:
    """Unknown paths, files and methods answer without the store's path or description."""
    store = SQLStore(runs_dir / "dash" / "store.sqlite")
    where = str(runs_dir.resolve())
    try:
        with (
            serve_in_thread(server_app(store, token=TOKEN)) as server,
            httpx.Client(base_url=server.url) as c,
        ):
            for path in ("/ui/loginx", "/ui/login/x", "/ui/static/nope.js", "/ui/static/../x"):
                answer = c.get(path)
                assert answer.status_code in (307, 404), path
                assert where not in answer.text and "store.sqlite" not in answer.text, path
                assert "reading" not in answer.text, path
            assert c.get("/ui/static/nope.js").status_code == 404
            assert c.put("/ui/login").status_code == 405
            sign_in(c, "/ui")  # signed in, the same page says where it reads
            assert where in c.get("/ui/static/nope.js").text
    finally:
        asyncio.run(store.close())


# ---- open resources -----------------------------------------------------------------------------
def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def make_runs(root: Path, count: int) -> list[str]:
    """``count`` run directories under ``root``, each with a tiny SQLite store holding one
    run (finished or still running) and one rollout; returns the run ids."""
    from voltrl.types import Run, Task

    async def one(i: int) -> str:
        store = SQLStore(root / f"run-{i:03d}" / "store.sqlite")
        try:
            status = "running" if i % 3 == 0 else "finished"
            run = await store.add_run(Run(name=f"run-{i:03d}", kind="fit", status=status))
            await store.enqueue([Task(input={"i": i})], run_id=run.run_id, resources_version=0)
            return run.run_id
        finally:
            await store.close()

    async def all_of_them() -> list[str]:
        return [await one(i) for i in range(count)]

    return asyncio.run(all_of_them())


MAX_OPEN = 16  # voltrl.observability.dashboard.open_stores.MAX_OPEN


@pytest.mark.slow
def test_a_catalog_of_many_runs_keeps_few_stores_open(tmp_path: Path) -> None:
    """Every page of 60 runs fetched: threads and file descriptors stay those of at most
    ``MAX_OPEN`` stores (each about 2 threads and 5 descriptors), not of 60."""
    run_ids = make_runs(tmp_path, 60)
    catalog = Catalog([tmp_path])
    with serve_in_thread(dashboard_app(catalog)) as server, httpx.Client(base_url=server.url) as c:
        assert c.get("/health-of-nothing").status_code == 404  # the connection is open
        fds, threads = open_fds(), threading.active_count()
        assert c.get("/").text.count("run-row") == 60
        for run_id in run_ids:
            page = c.get(f"/runs/{run_id}")
            assert page.status_code == 200 and run_id in page.text
        assert c.get("/workers").status_code == 200
        for run_id in run_ids[::20]:  # a rollout is looked for in every store
            rows = c.get(f"/rollouts?run_id={run_id}").text
            [rollout_id] = re.findall(r"/rollouts/(ro-[0-9a-f]+)", rows)
            assert rollout_id in c.get(f"/rollouts/{rollout_id}").text
        # the stores' threads, and those asyncio decodes tokens on (at most 6 on 2 cores)
        most = threads + 2 * MAX_OPEN + min(32, (os.cpu_count() or 1) + 4)
        deadline = time.monotonic() + 10  # a closed store's reader thread ends on its own
        while threading.active_count() > most and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() <= most
        assert open_fds() <= fds + 5 * MAX_OPEN + 10


def test_idle_stores_are_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the stores' clock, which the test moves: it stands still while the 8 runs' pages are
    fetched (all stay open, however slow), then passes ``idle_s``: all are closed."""
    from voltrl.observability.dashboard import open_stores

    now = [1000.0]
    monkeypatch.setattr(open_stores, "time", SimpleNamespace(monotonic=lambda: now[0]))
    run_ids = make_runs(tmp_path, 8)
    catalog = Catalog([tmp_path], idle_s=0.5)
    with serve_in_thread(dashboard_app(catalog)) as server, httpx.Client(base_url=server.url) as c:
        assert c.get("/health-of-nothing").status_code == 404
        fds, threads = open_fds(), threading.active_count()
        for run_id in run_ids:
            assert c.get(f"/runs/{run_id}").status_code == 200
        assert open_fds() >= fds + 8 * 3  # all open (a file, its WAL and index): under the bound
        now[0] += 1.0  # idle: the next look (every idle_s) closes them
        deadline = time.monotonic() + 60
        while (open_fds() > fds or threading.active_count() > threads) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert open_fds() <= fds and threading.active_count() <= threads
        assert c.get(f"/runs/{run_ids[0]}").status_code == 200  # opened again when needed


def test_the_counts_of_finished_runs_kept_in_memory_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dashboard left open over a store that gains runs for months keeps the counts of the
    latest few finished runs shown, not one entry per run for ever."""
    import voltrl.observability.dashboard.app as dashboard_module
    from voltrl.store.memory import InMemoryStore
    from voltrl.types import Run

    monkeypatch.setattr(dashboard_module, "FINISHED_COUNTS_KEPT", 2)
    store = InMemoryStore()

    async def finished_runs() -> None:
        for i in range(5):
            run = Run(name=f"r{i}", kind="dev", algorithm="baseline", status="finished")
            await store.add_run(run)

    asyncio.run(finished_runs())
    app = dashboard_app(Catalog([store]))
    with serve_in_thread(app) as server, httpx.Client(base_url=server.url) as c:
        assert c.get("/").status_code == 200  # every run's counts, for its row
        assert len(app.state.finished_counts) == 2
