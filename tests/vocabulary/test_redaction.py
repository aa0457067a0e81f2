"""One redactor (``voltrl._redact``) wherever a config or a resource leaves the process: a
database password planted in a trainer's store and in an SFT source reaches none of the sinks
(the store's run records, ``train.yaml``, the run directory's files, the trackers, the
dashboard's pages, ``voltrl show``, ``voltrl runs``, the console)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any, ClassVar, Literal

import httpx
import pytest
from helpers import voltrl
from sft_agents import TASKS, adding_agent, adding_teacher, teacher_module, tiny_model_dir

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


async def dashboard_pages(sources: list[str]) -> str:
    """The dashboard's runs page and every run's page over ``sources``, as one text."""
    catalog = Catalog(sources)
    transport = httpx.ASGITransport(app=dashboard_app(catalog))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            bodies = [(await c.get("/")).text]
            for entry in await catalog.runs():
                bodies.append((await c.get(f"/runs/{entry.run.run_id}")).text)
            return "\n".join(bodies)
    finally:
        await catalog.close()


def files_containing(root: Path, secret: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.mark.slow
def test_a_database_password_reaches_no_sink(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from pg import new_database_url  # a real PostgreSQL server (tests/pg.py), as the store tests

    database = with_password(new_database_url())
    teacher = teacher_module()
    runs = tmp_path / "runs"

    # A teacher's dev run recorded into PostgreSQL: the trainer's store spec holds the password.
    with teacher.serve_teacher(adding_teacher, seed=0) as url:
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

    html = asyncio.run(dashboard_pages([database, str(runs)]))
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


# ---- a secret under any name a provider uses ----------------------------------------------
HEADER_SECRETS = {
    "api-key": "s3cret-azure-api-key",  # Azure OpenAI's header
    "X-Api-Key": "s3cret-X-Api-Key",
    "apikey": "s3cret-apikey",
    "api_key": "s3cret-api_key",
    "X-Auth-Token": "s3cret-auth-token",
    "Client-Secret": "s3cret-client-secret",
    "Authorization": "Bearer s3cret-authorization",
    "Proxy-Authorization": "Basic s3cret-proxy-authorization",
    "Cookie": "session=s3cret-cookie",
}
URL_SECRETS = {"password": "s3cret-url-password", "api-key": "s3cret-query-api-key"}
EVERY_SECRET = [
    re.search(r"s3cret-[\w-]+", value)[0]  # type: ignore[index]
    for value in [*HEADER_SECRETS.values(), *URL_SECRETS.values()]
]


def test_secret_names_in_any_case_and_separator_are_recognised() -> None:
    from voltrl._redact import is_secret_key

    names = [*HEADER_SECRETS, "x-api-key", "aws_secret_access_key", "Set-Cookie", "client_secret"]
    names += ["Ocp-Apim-Subscription-Key", "passphrase"]
    for name in names:
        assert is_secret_key(name), name
    for name in ["api_key_env", "max_tokens", "stop_token_ids", "tokenizer", "keep_checkpoints"]:
        assert not is_secret_key(name), name
    url = "https://bob:pw@h.example/v1?api-version=1&api-key=k1&token=k2#top"
    assert redact(url) == "https://bob:***@h.example/v1?api-version=1&api-key=***&token=***#top"
    assert without_secrets(url) == "https://bob@h.example/v1?api-version=1#top"
    assert without_secrets("https://h/v1?apikey=k") == "https://h/v1"
    assert redact("https://h/v1?key=AIza1&sig=s2&v=1") == "https://h/v1?key=***&sig=***&v=1"


@vl.rollout
async def passes_its_sampling(task: dict, llm: vl.LLM) -> float:
    """One call with ``llm.sampling_parameters`` (its extra headers too)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": "hi"}], **llm.sampling_parameters
    )
    return 1.0


@pytest.mark.slow
def test_a_secret_under_any_header_or_query_name_reaches_no_sink_and_the_backend_gets_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """An LLM with a key in every kind of header and a password and key in its URL: its
    gateway sends the headers to the backend, and no file, store record, tracker config,
    page, ``voltrl show``/``runs`` output, console line or ``repr`` holds one of them."""
    from fake_openai_backend import FakeBackend

    runs = tmp_path / "runs"
    ConfigRecorder.configs.clear()
    sampling = {"temperature": 0.5, "extra_headers": {**HEADER_SECRETS, "x-team": "blue"}}
    url_llm = vl.LLM(
        endpoint=f"http://bob:{URL_SECRETS['password']}@127.0.0.1:9/v1"
        f"?api-version=1&api-key={URL_SECRETS['api-key']}",
        model="never-called",
    )

    async def fit() -> tuple[vl.RunResult, list[dict[str, Any]]]:
        async with FakeBackend() as fb:
            llm = vl.LLM(endpoint=fb.url, model="m", sampling_parameters=sampling)
            trainer = vl.Trainer(
                resources={"main_llm": llm, "user_llm": url_llm},
                run_dir=runs,
                name="keys",
                inline=True,
                progress=True,
                loggers=["tensorboard", ConfigRecorder()],
            )
            result = await trainer.fit_async(passes_its_sampling, [{"q": 1}, {"q": 2}])
            return result, fb.requests

    result, requests = asyncio.run(fit())
    assert result.rewards == [1.0, 1.0]
    for request in requests:  # the gateway sent the LLM's headers, secret or not
        sent = request["headers"]
        assert {k: sent.get(k.lower()) for k in HEADER_SECRETS} == HEADER_SECRETS
        assert sent["x-team"] == "blue"
        assert request["body"]["temperature"] == 0.5 and "extra_headers" not in request["body"]

    def leaks(text: str) -> list[str]:
        return [s for s in EVERY_SECRET if s in text]

    for secret in EVERY_SECRET:
        assert files_containing(tmp_path, secret) == [], secret
    assert leaks(json.dumps(ConfigRecorder.configs, default=str)) == []
    assert (
        leaks(
            repr(url_llm)
            + repr(vl.LLM(endpoint="http://h/v1", model="m", sampling_parameters=sampling))
        )
        == []
    )

    html = asyncio.run(dashboard_pages([str(runs)]))
    assert "keys" in html and leaks(html) == []
    for args in (["show", "keys", "--full"], ["runs", "--wide"]):
        out = voltrl(*args, "--run-dir", str(runs), cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert leaks(out.stdout + out.stderr) == []
    console = capfd.readouterr()
    assert leaks(console.out + console.err) == []
