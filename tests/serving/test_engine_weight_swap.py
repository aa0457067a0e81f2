"""A weight swap never waits for ever: when the engine thread fails while it holds an update
(vLLM raising on an abort it was handed in the same turn), the update fails with
:class:`EngineError` at once, so LocalRL's run fails instead of hanging with its
gateway paused. ``VLLMEngine``'s own code runs here against a stand-in for vLLM (installed as
the ``vllm`` modules it imports), since vLLM itself is not in this environment."""

from __future__ import annotations

import asyncio
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest

from voltrl.serving.engine.sampling import SamplingParams
from voltrl.serving.engine.sequences import EngineError


class FakeVLLM:
    """What ``VLLMEngine`` calls of vLLM's ``LLMEngine``; its ``step`` waits on ``gate``, and
    its ``abort_request`` raises, as a broken vLLM would."""

    def __init__(self) -> None:
        self.model_config = types.SimpleNamespace(get_vocab_size=lambda: 100, max_model_len=64)
        self.renderer = types.SimpleNamespace(render_cmpl=lambda prompts: prompts)
        self.engine_core = types.SimpleNamespace(shutdown=lambda: None)
        self.gate = threading.Event()
        self.stepping = threading.Event()
        self.requests: list[str] = []

    def add_request(self, request_id: str, prompt: Any, params: Any) -> None:
        self.requests.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return False  # the warm-up's request is done at once

    def step(self) -> list[Any]:
        self.stepping.set()
        self.gate.wait()
        return []

    def abort_request(self, request_ids: list[str]) -> None:
        raise RuntimeError("vLLM broke while aborting")

    def collective_rpc(self, *args: Any, **kwargs: Any) -> None:
        pass

    def reset_prefix_cache(self, **kwargs: Any) -> bool:
        return True


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeVLLM]:
    fake = FakeVLLM()
    modules = {
        "vllm": types.SimpleNamespace(SamplingParams=lambda **kw: kw),
        "vllm.sampling_params": types.SimpleNamespace(
            RequestOutputKind=types.SimpleNamespace(DELTA="delta")
        ),
        "vllm.engine.arg_utils": types.SimpleNamespace(EngineArgs=lambda **kw: kw),
        "vllm.v1.engine.llm_engine": types.SimpleNamespace(
            LLMEngine=types.SimpleNamespace(from_engine_args=lambda args: fake)
        ),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    yield fake
    fake.gate.set()


async def test_an_update_taken_with_an_abort_vllm_fails_on_fails_instead_of_hanging(
    fake_vllm: FakeVLLM, tmp_path: Any
) -> None:
    from voltrl.serving.engine.vllm import VLLMEngine

    engine = VLLMEngine(tmp_path, tokenizer=None, update_timeout_s=60)
    try:
        request = engine._submit([1, 2, 3], SamplingParams(max_tokens=5), None, None)
        while not fake_vllm.stepping.is_set():  # the request runs; vLLM is in a step
            await asyncio.sleep(0.01)
        request.aborted = True  # its client went (what closing its stream does)
        engine._abort(request)
        update = asyncio.ensure_future(engine.aupdate_weights({}, strict=False))
        while not engine._updates:  # handed over, the same turn as the abort
            await asyncio.sleep(0.01)
        fake_vllm.gate.set()  # the step ends; the thread takes both, and the abort raises
        with pytest.raises(EngineError, match="vLLM broke while aborting"):
            await asyncio.wait_for(update, 60)  # a bound for the test: it hung for ever
        assert not engine.running
    finally:
        engine.close()
