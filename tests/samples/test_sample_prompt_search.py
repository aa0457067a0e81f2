"""The prompt-search sample (samples/prompt_search/run.py) from its command line, against a
scripted OpenAI-compatible server playing both the classifier's model and the optimizer."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fake_openai_backend import FakeBackend
from helpers import SAMPLES, load_sample

data = load_sample("prompt_search", "data")
agent = load_sample("prompt_search", "agent")
LABEL = {row["text"]: row["label"] for split in ("train", "val") for row in data.rows(split)}
ASKS = "Is this review positive or negative? Answer with one word.\nReview: {text}"


def model(req: dict[str, Any]) -> dict[str, str]:
    """Labels a review only when asked to; critiques and rewrites when asked to."""
    prompt = req["messages"][-1]["content"]
    if "Do not write a new template yet" in prompt:
        return {"text": "The agent never says positive or negative: the prompt asks nothing."}
    if "<prompt>" in prompt:
        return {"text": f"<prompt>{ASKS}</prompt>"}
    review = prompt.rsplit("Review: ", 1)[-1]
    if "positive or negative" in prompt:
        return {"text": LABEL[review].capitalize() + "."}
    return {"text": "What a review! Thanks for sharing."}


@contextmanager
def served(script: Any) -> Iterator[str]:
    """A :class:`FakeBackend` on its own event loop in a thread; yields its ``/v1`` URL."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    backend = FakeBackend()
    backend.script = script

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(backend.start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield backend.url
    finally:
        asyncio.run_coroutine_threadsafe(backend.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_the_label_is_the_first_one_the_reply_names() -> None:
    assert agent.label_of("Positive.") == "positive"
    assert agent.label_of("This review is negative, not positive") == "negative"
    assert agent.label_of("What a lovely blanket!") is None
    assert agent.label_of("") is None


@pytest.mark.slow
def test_run_py_finds_a_template_that_asks_for_the_label(tmp_path: Path) -> None:
    with served(model) as url:
        done = subprocess.run(
            [sys.executable, str(SAMPLES / "prompt_search" / "run.py"), "--endpoint", url,
             "--model", "m", "--rounds", "2", "--beam-width", "1", "--branch-factor", "1",
             "--run-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = tmp_path / "prompt-search"
    final = json.loads((run_dir / "final" / "prompt_template.json").read_text())
    assert (final["template"], final["score"], final["start_score"]) == (ASKS, 1.0, 0.0)
    search = json.loads((run_dir / "prompt_search.json").read_text())
    assert search["stopped"] == "2 round(s) done"  # round 2's rewrite repeats, so is refused
    assert [c["status"] for c in search["candidates"]] == ["dropped", "kept", "rejected"]
    assert f"voltrl show {run_dir}" in done.stdout
    assert (run_dir / "prompt_search.png").stat().st_size > 0


def test_the_prompt_and_weights_yaml_builds_apo_then_local_rl(tmp_path: Path) -> None:
    """``prompt_and_weights.yaml`` (APO, then LocalRL, on SmolLM2) is a config ``voltrl train``
    takes whole, with the data ``data.py`` writes."""
    import yaml

    import voltrl as vl
    from voltrl.cli.train import build_from_config

    config = yaml.safe_load((SAMPLES / "prompt_search" / "prompt_and_weights.yaml").read_text())
    train, val = data.write(tmp_path / "data")
    assert [json.loads(x) for x in train.read_text().splitlines()] == data.rows("train")
    config["agent"] = f"{SAMPLES / 'prompt_search' / 'agent.py'}:classify"
    config["data"] = {"train": str(train), "val": str(val)}
    trainer, agent_, _, _ = build_from_config(config)
    algo = trainer.algorithm
    assert isinstance(algo, vl.LocalRL) and isinstance(algo.prompt_search, vl.APO)
    assert (
        algo.prompt_search.optimizer_llm is None and algo.prompt_search.prompt.template == "{text}"
    )
    assert algo.publishes == ("main_llm", "prompt_template")
    assert agent_.fn.__name__ == "classify"
