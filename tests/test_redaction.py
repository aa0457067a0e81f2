"""One redactor (``voltrl._redact``) wherever a config or a resource leaves the process: a
database password planted in a trainer's store and in an SFT source reaches none of the sinks
(the store's run records, ``train.yaml``, the run directory's files, the trackers, the
dashboard's pages, ``voltrl show``, ``voltrl runs``, the console)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, ClassVar, Literal

import httpx
import pytest
from helpers import voltrl
from test_sft import TASKS, adding_agent, adding_teacher, tiny_model_dir

import voltrl as vl
from voltrl._redact import redact, shown, without_secrets
from voltrl.observability.dashboard import Catalog, dashboard_app
from voltrl.observability.trackers import Logger
from voltrl.store import open_store

SECRET = "pl4nted-s3cret"


def test_urls_lose_their_passwords_and_secret_fields_their_values() -> None:
    dsn = f"postgresql://alice:{SECRET}@db.example:5432/runs"
    assert redact(f"cannot open {dsn}: refused") == (
        "cannot open postgresql://alice:***@db.example:5432/runs: refused"
    )
    assert redact("http://127.0.0.1:8400/v1 and runs/store.sqlite") == (
        "http://127.0.0.1:8400/v1 and runs/store.sqlite"
    )
    assert redact("postgresql://alice:p@ss:w@host/db") == "postgresql://alice:***@host/db"
    assert without_secrets("postgresql://alice@db/runs") == "postgresql://alice@db/runs"
    assert without_secrets("runs/store.sqlite") == "runs/store.sqlite"
    config = {
        "source": [dsn, "runs/teacher"],
        "backend_api_key": SECRET,
        "token": None,
        "max_tokens": 64,
        "api_key_env": "MY_KEY",
    }
    assert without_secrets(config) == {
        "source": ["postgresql://alice@db.example:5432/runs", "runs/teacher"],
        "token": None,
        "max_tokens": 64,
        "api_key_env": "MY_KEY",
    }
    assert shown(config)["backend_api_key"] == "***"
    assert SECRET not in json.dumps(shown(config))


class ConfigRecorder(Logger):
    """A tracker of one's own that keeps the config it was started with."""

    name: Literal["config-recorder"] = "config-recorder"
    configs: ClassVar[list[Any]] = []

    def start(self, run: vl.Run, run_dir: Path, config: Any) -> None:
        self.configs.append(config)


def with_password(url: str) -> str:
    """``postgresql://USER@host/db`` with the planted password (the test server trusts local
    connections, so any password connects)."""
    head, _, rest = url.partition("@")
    return f"{head}:{SECRET}@{rest}"


def files_containing(root: Path, secret: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.mark.slow
def test_a_database_password_reaches_no_sink(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from pg import new_database_url  # a real PostgreSQL server (tests/pg.py), as the store tests

    database = with_password(new_database_url())
    teacher_module = __import__("test_sft")._teacher_module()
    runs = tmp_path / "runs"

    # A teacher's dev run recorded into PostgreSQL: the trainer's store spec holds the password.
    with teacher_module.serve_teacher(adding_teacher, seed=0) as url:
        vl.Trainer(
            resources={"main_llm": vl.LLM(endpoint=url, model="teacher")},
            request_token_ids=False,
            store=database,
            run_dir=runs,
            name="teacher",
            inline=True,
            progress=False,
        ).dev(adding_agent, TASKS)

    # SFT reads it back: the algorithm's config (its source) holds the password too.
    sft = vl.SFT(tiny_model_dir(tmp_path), source=database, retokenize=True, steps=2)
    ConfigRecorder.configs.clear()
    loggers = ["tensorboard", ConfigRecorder()]
    trainer = vl.Trainer(sft, run_dir=runs, name="sft", progress=False, loggers=loggers)
    result = trainer.fit(adding_agent, TASKS)
    assert result.run.status == "finished"

    assert files_containing(tmp_path, SECRET) == []  # train.yaml, metrics, tensorboard, store
    assert ConfigRecorder.configs and SECRET not in json.dumps(ConfigRecorder.configs)
    yaml_text = (Path(result.run_dir) / "train.yaml").read_text()
    assert "postgresql://" in yaml_text  # the source is still named, without its password

    async def stored_configs() -> str:
        store = open_store(database)
        try:
            return json.dumps([r.model_dump() for r in await store.list_runs()])
        finally:
            await store.close()

    assert "teacher" in asyncio.run(stored_configs())
    assert SECRET not in asyncio.run(stored_configs())

    async def pages() -> str:
        catalog = Catalog([database, str(runs)])
        app = dashboard_app(catalog)
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
                bodies = [(await c.get("/")).text]
                for entry in await catalog.runs():
                    bodies.append((await c.get(f"/runs/{entry.run.run_id}")).text)
                return "\n".join(bodies)
        finally:
            await catalog.close()

    html = asyncio.run(pages())
    assert "sft" in html and "teacher" in html
    assert SECRET not in html

    for args in (["show", "teacher", "--store", database], ["show", "sft", "--full"]):
        out = voltrl(*args, "--run-dir", str(runs), cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert SECRET not in out.stdout + out.stderr
    out = voltrl("runs", "--run-dir", str(runs), "--wide", cwd=tmp_path)
    assert out.returncode == 0 and SECRET not in out.stdout + out.stderr

    console = capfd.readouterr()
    assert SECRET not in console.out + console.err
