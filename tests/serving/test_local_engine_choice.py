"""``LocalRL(engine=...)``: the built-in engine by default; ``"vllm"`` checked when LocalRL is
built (``tests_vllm/test_localrl_vllm.py`` trains with it, under ``make test-vllm``)."""

from __future__ import annotations

import importlib.util

import pytest

import voltrl as vl


def test_the_built_in_engine_is_the_default_and_is_recorded() -> None:
    config = vl.LocalRL("tiny").config()
    assert config["serving"]["engine"] == "local" and config["serving"]["engine_args"] is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"serving": {"engine": "vlm"}}, "engine must be one of 'local', 'vllm', not 'vlm'"),
        (
            {"serving": {"engine_args": {"enforce_eager": True}}},
            "engine_args are vLLM's EngineArgs",
        ),
        (
            {"serving": {"engine": "vllm"}, "lora_adapters": {"solver": "solver"}},
            "engine='vllm' serves no named LoRA adapters",
        ),
    ],
)
def test_a_bad_engine_choice_is_refused_when_local_rl_is_built(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        vl.LocalRL("tiny", **options)


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None,
    reason="vLLM is installed here, so its absence cannot be refused; make test-vllm runs it",
)
def test_vllm_without_vllm_installed_says_how_to_install_it() -> None:
    with pytest.raises(vl.VoltRLError, match=r"engine='vllm' needs vLLM installed .*pip install"):
        vl.LocalRL("tiny", serving={"engine": "vllm"})


def test_a_gpu_run_on_the_built_in_engine_is_pointed_at_vllm() -> None:
    from voltrl.serving.choice import engine_hint

    assert "serving={'engine': 'vllm'}" in (engine_hint("local", "cuda:0") or "")
    assert engine_hint("local", "cpu") is None
    assert engine_hint("vllm", "cuda") is None
