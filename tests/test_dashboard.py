"""The dashboard over HTTP: sign-in with a token, ``voltrl serve``'s ``/ui``, store URLs as
sources, clear answers to bad input. (Pages in a real browser: test_dashboard_browser.py.)"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from voltrl._http.serving import serve_in_thread
from voltrl.cli import main
from voltrl.cli.serve import server_app
from voltrl.errors import VoltRLError
from voltrl.observability.dashboard import Catalog, dashboard_app
from voltrl.store.http import store_app
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
    with pytest.raises(VoltRLError, match="no store at"):
        Catalog([tmp_path / "missing"])
    assert main(["dashboard", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "no store at" in capsys.readouterr().err


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


def test_a_run_started_after_the_dashboard_is_found_by_rollout_id(runs_dir: Path) -> None:
    import shutil
    import sqlite3

    root = runs_dir.parent / "later-runs"
    root.mkdir(exist_ok=True)
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
    from voltrl.observability.dashboard.data import TrainingRow, _advantages
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
