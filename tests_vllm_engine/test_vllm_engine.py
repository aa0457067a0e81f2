"""``VLLMEngine`` in this process: run by the vLLM environment's python (``make test-vllm``),
with voltrl imported from this tree. One engine on a tiny Qwen2 model serves every test (vLLM
starts in about 25 s on a CPU), in this order: the last test closes it. (vLLM's in-process
engine keeps process-wide state, which closing one engine tears down: one per process.)

Each test checks what the built-in engine promises (``core/serving/engine``) against
what vLLM does: logprobs equal transformers' for the same weights, ``n`` choices, top
logprobs, stop strings, aborts, refused parameters, and new weights loaded while a request
is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.serving.engine import EngineError, SamplingParams
from voltrl.serving.engine.vllm import VLLMEngine, vllm_engine_for

pytestmark = pytest.mark.timeout(600)
ARGS = {"enforce_eager": True, "max_model_len": 512}
TOLERANCE = 1e-3


def tiny(seed: int = 0) -> torch.nn.Module:
    """The tiny Qwen2 model vLLM's CPU attention accepts (heads of 32)."""
    tok = build_tiny_tokenizer()
    return build_tiny_model(tok, hidden=64, layers=2, heads=2, kv_heads=1, seed=seed)


def start(path: Path, max_batch_size: int = 8) -> VLLMEngine:
    """A vLLM engine on :func:`tiny` saved in ``path``."""
    tok = build_tiny_tokenizer()
    return vllm_engine_for(
        tiny(), tok, path, device="cpu", max_batch_size=max_batch_size, seed=0, engine_args=ARGS
    )


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMEngine]:
    eng = start(tmp_path_factory.mktemp("engine"))
    yield eng
    eng.close()


def prompt_ids(text: str = "Say a. Then say b.") -> list[int]:
    return build_tiny_tokenizer()(text)["input_ids"]


def gap(model: torch.nn.Module, prompt: list[int], ids: list[int], lps: list[float]) -> float:
    """Largest |recorded - transformers'| logprob over ``ids`` sampled after ``prompt``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    pairs = enumerate(zip(ids, lps, strict=True))
    return max(abs(ref[len(prompt) - 1 + i, t].item() - lp) for i, (t, lp) in pairs)


async def test_n_choices_each_with_their_raw_logprobs_and_top_alternatives(engine) -> None:
    prompt = prompt_ids()
    params = SamplingParams(max_tokens=6, n=3, top_logprobs=2, ignore_eos=True, seed=5)
    out = await engine.generate(prompt, params)
    assert [c.index for c in out.choices] == [0, 1, 2]
    model = engine.model
    for c in out.choices:
        assert len(c.token_ids) == len(c.logprobs) == len(c.top_logprobs) == 6
        assert c.finish_reason == "length"
        assert gap(model, prompt, c.token_ids, c.logprobs) < TOLERANCE
        for alts in c.top_logprobs:  # the 2 most likely, most likely first
            assert len(alts) == 2 and alts[0][1] >= alts[1][1]


async def test_a_stop_string_ends_the_choice_and_is_cut_from_its_text(engine) -> None:
    prompt = prompt_ids()
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    text = (await engine.generate(prompt, greedy)).choices[0].text
    stop = text[2:4]
    greedy.stop = [stop]
    c = (await engine.generate(prompt, greedy)).choices[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.index(stop)]


async def test_a_request_closed_early_is_aborted_and_others_go_on(engine) -> None:
    prompt = prompt_ids()
    stream = engine.stream(prompt, SamplingParams(max_tokens=400, ignore_eos=True))
    async with contextlib.aclosing(stream) as it:
        async for _ in it:
            break
    outs = await asyncio.gather(
        *(engine.generate(prompt, SamplingParams(max_tokens=10, seed=i)) for i in range(8))
    )
    assert all(len(o.choices[0].token_ids) >= 1 for o in outs)
    await asyncio.sleep(0.5)
    assert engine.describe()["running"] == 0


async def test_parameters_vllm_refuses_are_a_bad_request_and_harm_no_one(engine) -> None:
    with pytest.raises(ValueError, match="vLLM refuses these sampling parameters"):
        engine.stream(prompt_ids(), SamplingParams(max_tokens=4, temperature=3.0))
    out = await engine.generate(prompt_ids(), SamplingParams(max_tokens=4, seed=2**64 + 3, n=2))
    assert len(out.choices) == 2 and engine.running


async def test_weights_that_do_not_match_are_refused_before_vllm_sees_them(engine) -> None:
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(ValueError, match="do not match the served model"):
        await engine.aupdate_weights({"nope": torch.zeros(1)})
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    out = await engine.generate(prompt_ids(), SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.weights_version == 0 and len(out.choices[0].token_ids) == 3


async def test_new_weights_reach_requests_in_flight_and_the_prefix_cache(engine) -> None:
    long_prompt = prompt_ids("Say a. " * 40)
    await engine.generate(long_prompt, SamplingParams(max_tokens=2))  # cached prefix
    stream = engine.stream(prompt_ids(), SamplingParams(max_tokens=300, ignore_eos=True))
    async with contextlib.aclosing(stream) as it:
        first = await anext(it)
        new = {k: v * 1.05 for k, v in tiny().state_dict().items()}
        version = await engine.aupdate_weights(new)
        later = [d async for d in it]
    assert version == 1 and first[0].token_ids and later[-1][-1].finish_reason == "length"
    updated = tiny()
    updated.load_state_dict(new)
    out = await engine.generate(long_prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    c = out.choices[0]
    assert engine.weights_version == 1
    assert gap(updated, long_prompt, c.token_ids, c.logprobs) < TOLERANCE
    assert gap(tiny(), long_prompt, c.token_ids, c.logprobs) > 10 * TOLERANCE
    assert torch.equal(engine.model.state_dict()["lm_head.weight"], new["lm_head.weight"])


async def test_a_closed_engine_refuses_requests_and_weights(engine) -> None:
    engine.close()  # the last test: the module's engine closes here
    assert not engine.running
    with pytest.raises(EngineError, match="closed"):
        await engine.generate(prompt_ids(), SamplingParams(max_tokens=2))
    with pytest.raises(EngineError, match="closed"):
        await engine.aupdate_weights(tiny().state_dict())
