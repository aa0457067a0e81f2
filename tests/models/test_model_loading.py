"""What a ``model`` argument that cannot be loaded says: a hub name while the hub cannot be
reached fails at once in one line (no minute of retries), a mistyped local path says the
directory does not exist; a hub name in the cache loads with the hub unreachable; and a long
prompt tokenized by a loaded tokenizer gives no "indexing errors" warning."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port

import voltrl as vl
from voltrl.models.loading import load_model, load_tokenizer
from voltrl.models.tiny import build_tiny, build_tiny_tokenizer

SCRIPT = """\
import sys
import voltrl as vl

def agent(task, llm):
    return 1.0

trainer = vl.Trainer(vl.LocalRL(sys.argv[1], steps=1), run_dir="runs", progress=False)
try:
    trainer.fit(agent, [{"q": 1}])
except vl.VoltRLError as exc:
    print("error:", exc)
"""


def _run(tmp_path: Path, script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``script`` run as a user's file in ``tmp_path`` with ``env`` added, the hub's cache
    a directory there (empty unless the test fills it), no proxy and no other hub settings."""
    (tmp_path / "script.py").write_text(script)
    base = {
        k: v
        for k, v in os.environ.items()
        if "proxy" not in k.lower() and not k.startswith(("HF_", "TRANSFORMERS_"))
    }
    return subprocess.run(
        [sys.executable, "script.py", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env={**base, "HF_HUB_CACHE": str(tmp_path / "hub"), **env},
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hub_name_with_the_hub_unreachable_fails_at_once_in_one_line(tmp_path):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    out = _run(tmp_path, SCRIPT, "Qwen/Qwen2.5-0.5B-Instruct", HF_ENDPOINT=endpoint)
    [line] = [x for x in out.stdout.splitlines() if x.startswith("error:")]
    assert line == (
        "error: cannot load a model from Qwen/Qwen2.5-0.5B-Instruct: it is not a local "
        "directory, the Hugging Face cache does not hold it, and the hub at "
        f"{endpoint} cannot be reached (Connection refused); pass a local directory holding "
        'the model, "tiny", or a packaged model (voltrl model list)'
    ), out.stdout + out.stderr
    assert "Retrying" not in out.stderr and "Retry" not in out.stdout, out.stderr  # none tried


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hub_name_in_offline_mode_says_so(tmp_path):
    script = (
        "import voltrl as vl\n"
        "from voltrl.models.loading import load_model\n"
        "try:\n"
        "    load_model('Qwen/Qwen2.5-0.5B-Instruct')\n"
        "except vl.VoltRLError as exc:\n"
        "    print('error:', exc)\n"
    )
    out = _run(tmp_path, script, HF_HUB_OFFLINE="1")
    assert (
        "the Hugging Face cache does not hold it, and the hub is offline (HF_HUB_OFFLINE is set); "
        'pass a local directory holding the model, "tiny", or a packaged model (voltrl model list)'
    ) in out.stdout, out.stdout + out.stderr
    assert "Retrying" not in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hub_name_in_the_cache_loads_while_the_hub_cannot_be_reached(tmp_path):
    model, tokenizer = build_tiny(hidden=32)
    snapshot = tmp_path / "hub" / "models--someone--tiny-chat" / "snapshots" / "abc123"
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    script = (
        "from voltrl.models.loading import load_model\n"
        "model, tokenizer = load_model('someone/tiny-chat', device='cpu')\n"
        "print('loaded', model.config.hidden_size, len(tokenizer))\n"
    )
    out = _run(tmp_path, script, HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    assert f"loaded 32 {len(tokenizer)}" in out.stdout, out.stdout + out.stderr
    assert "Retrying" not in out.stderr, out.stderr


@pytest.mark.parametrize("path", ["./models/my-modle", "models/a/b", "~/no-such-model-dir"])
def test_a_local_path_that_does_not_exist_says_so(path):
    with pytest.raises(vl.VoltRLError) as raised:
        load_model(path)
    assert str(raised.value) == (
        f"cannot load a model from {path}: the directory {path} does not exist"
    )


@pytest.mark.parametrize("path", ["./models/my-modle", "models/a/b", "~/no-such-model-dir"])
def test_a_tokenizer_from_a_local_path_that_does_not_exist_says_so(path):
    with pytest.raises(vl.VoltRLError) as raised:
        load_tokenizer(path)
    assert str(raised.value) == f"cannot load the tokenizer of {path}: the directory does not exist"


def test_a_tokenizer_by_hub_name_neither_cached_nor_reachable_says_so(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(vl.VoltRLError) as raised:
        load_tokenizer("nobody/no-such-model")
    assert str(raised.value) == (
        "cannot load the tokenizer of nobody/no-such-model: it is not in the Hugging Face "
        "cache, and the hub is offline (HF_HUB_OFFLINE is set)"
    )


def test_load_tokenizer_reads_tiny_and_a_directory_as_load_model_does(tmp_path):
    build_tiny_tokenizer().save_pretrained(tmp_path / "tok")
    text = "Player3 voted Player7."
    expected = build_tiny_tokenizer()(text).input_ids
    assert load_tokenizer("tiny")(text).input_ids == expected
    assert load_tokenizer(tmp_path / "tok")(text).input_ids == expected
    assert load_tokenizer(str(tmp_path / "tok"))(text).input_ids == expected


def test_a_path_object_is_a_directory_even_where_it_reads_as_a_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(vl.VoltRLError, match="the directory models/my-modle does not exist"):
        load_model(Path("models/my-modle"))


class _Records(logging.Handler):
    """The messages logged to the logger it is added to."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_prompt_longer_than_the_tokenizers_maximum_gives_no_indexing_warning():
    records = _Records()
    logger = logging.getLogger("transformers.tokenization_utils_base")
    logger.addHandler(records)
    try:
        long_text = "the customer wants to change a flight " * 2000
        plain = build_tiny_tokenizer()  # as transformers gives it: warns
        assert len(plain.encode(long_text)) > plain.model_max_length
        assert any("indexing errors" in m for m in records.messages)
        records.messages.clear()
        by_name = load_model("tiny", device="cpu")[1]
        model, fresh = build_tiny()  # a model object with a tokenizer that has not warned yet
        given = load_model(model, fresh, device="cpu")[1]
        for tokenizer in (by_name, given):
            assert len(tokenizer.encode(long_text)) > tokenizer.model_max_length
        assert records.messages == []
    finally:
        logger.removeHandler(records)
