"""``LocalRL(engine="vllm")``: vLLM in the trainer's process serves the rollouts, and after an
update it serves the updated weights, with no restart.

Not part of ``make test`` (``make test-vllm`` runs it, as ``test_gateway_vllm.py``). The run
itself happens under the vLLM environment's python (``localrl_vllm_run.py``: one LocalRL step
on a tiny model, every weight trained or a LoRA adapter, then a validation), importing voltrl
from this tree; this module then reads
its store and recomputes, with transformers, the logprobs of every token vLLM sampled: under
the initial weights for the step's rollouts, under ``final/`` (the updated weights) for the
validation after it, which must also differ from the initial weights' logprobs.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.store.sql import SQLStore

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = os.environ.get("VOLTRL_VLLM_PYTHON", "")
TIMEOUT_S = 900.0
TOLERANCE = 1e-3
"""Largest difference allowed between a logprob vLLM recorded and transformers' (float32 on
both sides: measured up to about 1e-5 here)."""

pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


@pytest.fixture(scope="module", params=["full", "lora"])
def run_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run ``localrl_vllm_run.py`` under the vLLM environment, training every weight or a
    LoRA adapter; its run directory."""
    if not VLLM_PYTHON or not os.access(VLLM_PYTHON, os.X_OK):
        pytest.fail("VOLTRL_VLLM_PYTHON must name vLLM's python: run `make test-vllm`")
    tmp = tmp_path_factory.mktemp("localrl-vllm")
    tree = tmp / "tree"
    tree.mkdir()
    (tree / "voltrl").symlink_to(ROOT / "core")  # this tree's voltrl, not an installed one
    log = tmp / "run.log"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with log.open("w") as out:
        proc = subprocess.run(
            [
                VLLM_PYTHON,
                str(ROOT / "tests_vllm" / "localrl_vllm_run.py"),
                str(tmp / "runs"),
                *(["lora"] if request.param == "lora" else []),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=TIMEOUT_S,
            check=False,
        )
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        pytest.fail(f"the LocalRL run failed ({proc.returncode}); log {log}:\n{tail}")
    return tmp / "runs" / ("vllm-lora" if request.param == "lora" else "vllm")


def recorded(run_dir: Path) -> dict[tuple[str, int], list]:
    """The run's model calls, by (rollout mode, the store's resources version)."""

    async def read() -> dict[tuple[str, int], list]:
        store = SQLStore(run_dir / "store.sqlite")
        try:
            calls: dict[tuple[str, int], list] = {}
            for r in await store.query_rollouts():
                key = (r.mode, r.resources_version or 0)
                calls.setdefault(key, []).extend(await store.get_llm_calls(r.rollout_id))
            return calls
        finally:
            await store.close()

    return asyncio.run(read())


def gaps(model: torch.nn.Module, calls: list) -> list[float]:
    """For every sampled token of ``calls``: |recorded logprob - ``model``'s logprob|."""
    out = []
    with torch.no_grad():
        for call in calls:
            prompt, response = call.prompt_token_ids, call.response_token_ids
            logits = model(torch.tensor([prompt + response])).logits[0].float()
            lps = torch.log_softmax(logits, dim=-1)
            for i, token in enumerate(response):
                out.append(abs(lps[len(prompt) - 1 + i, token].item() - call.response_logprobs[i]))
    return out


def test_localrl_on_vllm_samples_from_the_weights_of_each_step(run_dir: Path) -> None:
    calls = recorded(run_dir)
    (train_version,) = [v for mode, v in calls if mode == "train"]
    before, after = sorted(v for mode, v in calls if mode == "val")
    assert before < train_version < after  # validations before and after the one update
    trained, validated = calls[("train", train_version)], calls[("val", after)]
    assert len(trained) == 32 and len(validated) == 4
    assert all(c.response_token_ids and c.response_logprobs for c in trained + validated)
    tok = build_tiny_tokenizer()
    initial = build_tiny_model(tok, hidden=64, layers=2, heads=2, kv_heads=1, seed=0)
    updated = AutoModelForCausalLM.from_pretrained(run_dir / "final", dtype=torch.float32).eval()
    # The step's rollouts and the first validation: the initial weights' logprobs.
    assert max(gaps(initial, trained + calls[("val", before)])) < TOLERANCE
    # The validation after the update: the updated weights', which the initial ones are not.
    assert max(gaps(updated, validated)) < TOLERANCE
    assert max(gaps(initial, validated)) > 10 * TOLERANCE


def test_the_copy_vllm_started_from_is_removed_and_final_holds_the_model(run_dir: Path) -> None:
    assert not (run_dir / "engine_model").exists()
    assert (run_dir / "final" / "config.json").is_file()


def test_a_model_vllm_cannot_run_fails_at_setup_saying_why(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "voltrl").symlink_to(ROOT / "core")
    proc = subprocess.run(
        [VLLM_PYTHON, str(ROOT / "tests_vllm" / "localrl_vllm_run.py"), str(tmp_path), "heads16"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tree)},
        timeout=TIMEOUT_S,
        check=False,
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "vLLM started but cannot generate with this model" in out
    assert "head_dim=16" in out  # vLLM's own reason
    assert "gateway POST" not in out  # at setup: no model call was made, none retried


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
