"""The voltrl command line: dev against a real OpenAI-compatible server, runs, clear errors."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest
from helpers import ROOT, FakeBackendProcess, free_port, recorded_calls, voltrl, voltrl_here

SAMPLE = ROOT / "samples" / "quickstart"


@pytest.fixture(scope="module")
def backend() -> Iterator[str]:
    with FakeBackendProcess() as url:
        yield url


@pytest.mark.slow
def test_dev_runs_an_agent_file_against_an_endpoint_and_runs_lists_it(tmp_path, backend):
    out = voltrl(
        "dev",
        f"{SAMPLE / 'agent.py'}:agent",
        "--data",
        str(SAMPLE / "tasks.jsonl"),
        "--llm-endpoint",
        backend,
        "--model",
        "fake-model",
        "--name",
        "smoke",
        "--run-dir",
        str(tmp_path / "runs"),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "dev" in out.stdout and "8" in out.stdout
    store_path = tmp_path / "runs" / "smoke" / "store.sqlite"
    calls = asyncio.run(recorded_calls(store_path))
    assert len(calls) == 8  # one per rollout, recorded by the gateway dev put in front
    assert all(c.has_token_ids and c.model == "fake-model" for c in calls)
    assert {c.request["max_tokens"] for c in calls} == {1024}  # the default cap
    assert "a call that sets no max_tokens gets at most 1024 tokens" in out.stdout
    runs = voltrl("runs", "--run-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert runs.returncode == 0, runs.stderr
    assert "smoke" in runs.stdout and "dev" in runs.stdout


@pytest.mark.slow
def test_dev_sampling_flags_reach_the_agents_llm(tmp_path, backend):
    out = voltrl(
        "dev",
        f"{SAMPLE / 'agent.py'}:agent",
        "--data",
        str(SAMPLE / "tasks.jsonl"),
        "--llm-endpoint",
        backend,
        "--model",
        "fake-model",
        "--max-tokens",
        "7",
        "--temperature",
        "0.3",
        "--top-p",
        "0.9",
        "--name",
        "sampled",
        "--run-dir",
        str(tmp_path / "runs"),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    calls = asyncio.run(recorded_calls(tmp_path / "runs" / "sampled" / "store.sqlite"))
    assert calls and all(c.request["max_tokens"] == 7 for c in calls)
    assert all(c.request["temperature"] == 0.3 and c.request["top_p"] == 0.9 for c in calls)


def test_dev_whose_rollouts_all_fail_prints_the_error_and_exits_1_with_one_line(tmp_path):
    (tmp_path / "broken.py").write_text(
        "import voltrl as vl\n\n\n"
        "@vl.rollout\n"
        "def agent(task, resources):\n"
        "    return {'not': 'a reward'}[task['key']]\n"
    )
    (tmp_path / "tasks.jsonl").write_text('{"key": "a"}\n{"key": "b"}\n')
    out = voltrl(
        "dev",
        "broken.py:agent",
        "--data",
        "tasks.jsonl",
        "--llm-endpoint",
        "http://127.0.0.1:9/v1",
        "--model",
        "m",
        "--skip-endpoint-check",
        "--inline",
        cwd=tmp_path,
    )
    assert out.returncode == 1
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("voltrl: error: the run stopped: all 2 rollouts failed")
    assert "KeyError: 'a'" in out.stdout and 'broken.py", line 6, in agent' in out.stdout
    assert "failures: 2 of 2 rollouts failed" in out.stdout


@pytest.mark.slow
def test_dev_with_a_bad_module_path_says_so(tmp_path):
    for spec, message in [
        ("no_such_module:agent", "cannot import module 'no_such_module'"),
        ("json:no_attr", "has no attribute 'no_attr'"),
        ("missing.py:agent", "does not exist"),
        ("noseparator", "expected MODULE:AGENT"),
    ]:
        out = voltrl(
            "dev",
            spec,
            "--data",
            "x.jsonl",
            "--llm-endpoint",
            "http://x/v1",
            "--model",
            "m",
            cwd=tmp_path,
        )
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_dev_with_a_missing_data_file_says_so(tmp_path):
    out = voltrl(
        "dev",
        f"{SAMPLE / 'agent.py'}:agent",
        "--data",
        "nope.jsonl",
        "--llm-endpoint",
        "http://127.0.0.1:1/v1",
        "--model",
        "m",
        cwd=tmp_path,
    )
    assert out.returncode == 2 and "nope.jsonl does not exist" in out.stderr


@pytest.mark.slow
def test_dev_with_an_unreachable_endpoint_says_so(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": 2}) + "\n")
    out = voltrl(
        "dev",
        f"{SAMPLE / 'agent.py'}:agent",
        "--data",
        str(data),
        "--llm-endpoint",
        f"http://127.0.0.1:{free_port()}/v1",
        "--model",
        "m",
        cwd=tmp_path,
    )
    assert out.returncode == 2 and "no OpenAI-compatible endpoint answers" in out.stderr
    assert not (tmp_path / "runs").exists()


def test_runs_on_an_empty_directory_says_there_are_none(tmp_path):
    out = voltrl("runs", "--run-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0 and "no runs found" in out.stdout


@pytest.mark.slow
def test_train_runs_local_rl_from_a_yaml_config(tmp_path, capsys, monkeypatch):
    import yaml

    from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    build_tiny_model(tok, seed=0).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"letter": c}) + "\n" for c in "ab"))
    config = {
        "agent": f"{ROOT / 'tests' / 'rl_agents.py'}:two_turn_agent",
        "data": {"train": str(data)},
        "algorithm": {
            "name": "local_rl",
            "model": str(tmp_path / "model"),
            "schedule": {"steps": 1, "tasks_per_step": 2, "group_size": 2},
            "sampling": {"max_tokens": 4},
            "update": {"lr": 1e-3, "rollout_correction": "tis"},
            "serving": {"dtype": "bfloat16"},
        },
        "trainer": {"n_runners": 1, "run_dir": str(tmp_path / "runs"), "name": "yaml"},
    }
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    here = {"capsys": capsys, "monkeypatch": monkeypatch}
    out = voltrl_here("train", str(tmp_path / "train.yaml"), cwd=tmp_path, **here)
    assert out.returncode == 0, out.stderr[-2000:]
    metrics = [
        json.loads(x) for x in (tmp_path / "runs/yaml/metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics if "update/loss" in m] == [1]
    assert (tmp_path / "runs" / "yaml" / "final" / "config.json").exists()
    # a float32 policy served in bfloat16: the update measures the engine against itself
    # and weighs its tokens (docs/fidelity.md); the run records both settings
    step = next(m for m in metrics if "update/loss" in m)
    assert step["mismatch/logprob_abs_mean"] > 0 and 0 <= step["mismatch/truncated"] <= 1
    recorded = yaml.safe_load((tmp_path / "runs/yaml/train.yaml").read_text())["algorithm"]
    assert recorded["update"]["rollout_correction"] == "tis"
    assert recorded["serving"]["dtype"] == "bfloat16"


@pytest.mark.slow
def test_train_with_a_bad_config_says_what_is_wrong(tmp_path, capsys, monkeypatch):
    here = {"capsys": capsys, "monkeypatch": monkeypatch}
    cfg = tmp_path / "c.yaml"
    for text, message in [
        ("agent: x:y\nwhat: 1\n", "unknown config sections ['what']"),
        ("agent: x:y\n", "needs a 'data' section"),
        ("agent: x:y\ndata: {train: a.jsonl}\nalgorithm: {name: ppo}\n", "unknown algorithm 'ppo'"),
        ("- a list\n", "must be a mapping"),
    ]:
        cfg.write_text(text)
        out = voltrl_here("train", str(cfg), cwd=tmp_path, **here)
        assert out.returncode == 2 and message in out.stderr, out.stderr
    out = voltrl_here("train", str(tmp_path / "missing.yaml"), cwd=tmp_path, **here)
    assert out.returncode == 2 and "does not exist" in out.stderr


@pytest.mark.slow
def test_runner_errors_are_one_line_each(tmp_path):
    """A bad agent, a store that is not a URL, an unreachable store, a wrong token."""
    from voltrl._http.serving import serve_in_thread
    from voltrl.store.http.endpoints import store_app
    from voltrl.store.memory import InMemoryStore

    agent = f"{ROOT / 'tests' / 'fault_agents.py'}:Trivial"
    dead = f"http://127.0.0.1:{free_port()}"
    with serve_in_thread(store_app(InMemoryStore(), token="right")) as server:
        for args, message in [
            (["--store", server.url, "--agent", "nope:agent"], "cannot import module 'nope'"),
            (["--store", "runs/store.sqlite", "--agent", agent], "must be a store server URL"),
            (["--store", dead, "--agent", agent], f"store server {dead} unreachable"),
            (["--store", server.url, "--agent", agent, "--token", "wrong"], "401 Unauthorized"),
            (["--store", server.url, "--agent", agent, "--workers", "0"], "at least 1"),
        ]:
            out = voltrl("runner", *args, cwd=tmp_path)
            assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
            assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_dev_with_a_model_the_endpoint_does_not_serve_says_which_it_serves(tmp_path, backend):
    out = voltrl(
        "dev",
        f"{SAMPLE / 'agent.py'}:agent",
        "--data",
        str(SAMPLE / "tasks.jsonl"),
        "--llm-endpoint",
        backend,
        "--model",
        "gpt-4o",
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr
    assert "'gpt-4o' is not served" in out.stderr and "it serves fake-model" in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("status", "body"), [(404, b'{"error": "no such route"}'), (200, b"<html>models</html>")]
)
def test_endpoint_check_passes_an_endpoint_without_a_model_list(status: int, body: bytes):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from voltrl.cli.endpoints import check_endpoint

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            check_endpoint(f"http://127.0.0.1:{server.server_port}/v1", "key", "gpt-4o")
        finally:
            server.shutdown()


def test_check_llm_names_what_it_checked(monkeypatch) -> None:
    import voltrl as vl
    from voltrl.cli.endpoints import check_llm

    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    keyless = vl.LLM(endpoint="http://127.0.0.1:1/v1", model="m", api_key_env="NO_SUCH_KEY_VAR")
    with pytest.raises(vl.VoltRLError, match=r"the judge's endpoint: \$NO_SUCH_KEY_VAR"):
        check_llm(keyless, "the judge's endpoint")
    dead = vl.LLM(endpoint="http://127.0.0.1:1/v1", model="m")
    with pytest.raises(vl.VoltRLError, match="the judge's endpoint: no OpenAI-compatible"):
        check_llm(dead, "the judge's endpoint")
