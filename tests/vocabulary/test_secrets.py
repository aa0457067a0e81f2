"""Secrets stay secret: a provider API key given in an ``LLM`` is never written to the store,
served by the store server, printed or shown in a repr; agents still get the keys they need
(the backend's through the gateway, or the key itself without one), and the run's token
reaches remote runners through a file, never the printed command."""

from __future__ import annotations

import sys
from pathlib import Path

import aiohttp
import pytest
from fake_openai_backend import FakeBackend

import voltrl as vl
from voltrl._http.serving import serve
from voltrl.cli.serve import server_app
from voltrl.resources import ApiKeys
from voltrl.store.sql import SQLStore

SECRET = "sk-secret-" + "5e1f" * 8


def files_containing(root: Path, secret: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


async def served_answers(store_path: Path) -> str:
    """Every store route that returns data, asked of a server on ``store_path``."""
    store = SQLStore(store_path)
    url, stop = await serve(server_app(store, token="t"))
    headers = {"Authorization": "Bearer t"}
    bodies = []
    try:
        async with aiohttp.ClientSession(headers=headers) as http:
            for path in ("/v1/store/resources", "/v1/store/resources?version=1", "/v1/store/runs"):
                async with http.get(f"{url}{path}") as response:
                    assert response.status == 200
                    bodies.append(await response.text())
            for rollout in await store.query_rollouts():
                for what in ("", "/llm_calls", "/attempts", "/spans"):
                    async with http.get(f"{url}/v1/store/rollouts/{rollout.rollout_id}{what}") as r:
                        bodies.append(await r.text())
    finally:
        await stop()
        await store.close()
    return "\n".join(bodies)


@pytest.mark.slow
@pytest.mark.parametrize("record_calls", [True, False], ids=["behind-gateway", "direct"])
async def test_a_provider_key_is_never_stored_served_or_printed(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], record_calls: bool
) -> None:
    from serving_agents import calls_once

    async with FakeBackend() as backend:
        llm = vl.LLM(endpoint=backend.url, model="m", api_key=SECRET)
        trainer = vl.Trainer(
            resources={"main_llm": llm},
            record_calls=record_calls,
            run_dir=tmp_path,
            name="run",
            n_runners=1,  # a spawned worker process: keys travel in memory, not via the store
        )
        result = await trainer.dev_async(calls_once, [{"q": 1}, {"q": 2}])

    assert result.rewards == [1.0, 1.0]
    # The backend got the key every time: from the gateway, or from the agent itself.
    assert [r["authorization"] for r in backend.requests] == [f"Bearer {SECRET}"] * 2
    assert files_containing(tmp_path, SECRET) == []
    served = await served_answers(tmp_path / "run" / "store.sqlite")
    assert '"main_llm"' in served and SECRET not in served
    out = capfd.readouterr()
    assert SECRET not in out.out + out.err
    assert SECRET not in repr(llm) and SECRET not in llm.model_dump_json()


def test_keys_are_put_back_by_the_runner_only(monkeypatch: pytest.MonkeyPatch) -> None:
    stored = vl.Resources.model_validate_json(
        vl.Resources(
            items={
                "gw": vl.LLM(endpoint="http://g/v1", model="m", gateway=True, api_key="tok"),
                "hosted": vl.LLM(endpoint="http://h/v1", model="m", api_key=SECRET),
                "by_env": vl.LLM(endpoint="http://e/v1", model="m", api_key_env="MY_TEST_KEY"),
            }
        ).model_dump_json()
    )
    assert {llm.api_key for llm in stored.of_kind(vl.LLM).values()} == {"EMPTY"}
    monkeypatch.setenv("MY_TEST_KEY", "from-env")
    filled = stored.with_keys(ApiKeys(gateway="run-token", llms={"hosted": SECRET}))
    monkeypatch.delenv("MY_TEST_KEY")
    keys = {name: llm.api_key for name, llm in filled.of_kind(vl.LLM).items()}
    assert keys == {"gw": "run-token", "hosted": SECRET, "by_env": "from-env"}
    assert "run-token" not in repr(ApiKeys(gateway="run-token"))
    with pytest.raises(vl.VoltRLError, match=r"\$MY_TEST_KEY, which is not set"):
        stored.with_keys(ApiKeys())


def test_a_runner_reads_its_token_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from voltrl.cli.main import build_parser
    from voltrl.cli.options import bearer_token

    monkeypatch.delenv("VOLTRL_TOKEN", raising=False)

    token_file = tmp_path / "token"
    token_file.write_text("file-token\n")
    parse = build_parser().parse_args
    base = ["runner", "--store", "http://127.0.0.1:1", "--agent", "m:a"]
    assert bearer_token(parse([*base, "--token-file", str(token_file)])) == "file-token"
    monkeypatch.setenv("VOLTRL_TOKEN", "env-token")
    assert bearer_token(parse(base)) == "env-token"
    monkeypatch.delenv("VOLTRL_TOKEN")
    (tmp_path / "empty").write_text("")
    with pytest.raises(vl.VoltRLError, match="is empty"):
        bearer_token(parse([*base, "--token-file", str(tmp_path / "empty")]))


def test_the_printed_runner_command_names_a_token_file(tmp_path: Path) -> None:
    """``n_runners=0``: the command to start remote runners reads the token from an
    owner-only file, which lives as long as the run; the token itself is not printed (a real
    trainer runs to the point where it waits; the test looks while it waits)."""
    import subprocess

    token_file = tmp_path / "remote" / "runner.token"
    script = f"""
import asyncio, os, stat, voltrl as vl
def agent(task, resources):
    return 1.0
async def main():
    trainer = vl.Trainer(
        n_runners=0, run_dir={str(tmp_path)!r}, name="remote", token="tok-{"9" * 20}"
    )
    run = asyncio.ensure_future(trainer.dev_async(agent, [{{"q": 1}}]))
    while not os.path.exists({str(token_file)!r}):
        await asyncio.sleep(0.1)
    print("mode", oct(stat.S_IMODE(os.stat({str(token_file)!r}).st_mode)), flush=True)
    print("token matches", open({str(token_file)!r}).read().strip() == "tok-" + "9" * 20)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
asyncio.run(main())
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert f"--token-file {token_file}" in out.stdout, out.stdout + out.stderr
    assert "mode 0o600" in out.stdout and "token matches True" in out.stdout
    assert "9" * 20 not in out.stdout + out.stderr
    assert not token_file.exists()  # gone with the run
    assert files_containing(tmp_path / "remote", "9" * 20) == []


async def test_a_key_from_api_key_env_reaches_the_backend_through_the_gateway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from serving_agents import calls_once

    monkeypatch.setenv("MY_PROVIDER_KEY", SECRET)
    async with FakeBackend() as backend:
        llm = vl.LLM(endpoint=backend.url, model="m", api_key_env="MY_PROVIDER_KEY")
        trainer = vl.Trainer(resources={"main_llm": llm}, run_dir=tmp_path, inline=True)
        result = await trainer.dev_async(calls_once, [{"q": 1}])
    assert result.rewards == [1.0]
    assert [r["authorization"] for r in backend.requests] == [f"Bearer {SECRET}"]
    assert files_containing(tmp_path, SECRET) == []
