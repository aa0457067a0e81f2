"""Generate the tiny tokenizer fixture that tests and demos use instead of a hub download.

Trains a byte-level BPE (vocabulary ``VOCAB_SIZE``) on a small built-in corpus of arithmetic and
calculator-agent text plus printable ASCII, adds ChatML special tokens and Hermes tool-call
tokens, attaches a ChatML chat template with Hermes tool calls (Qwen2.5-style turns; tools
are listed compactly as ``name(param, ...)`` to keep sequences short for CPU training), and
saves it with ``save_pretrained`` into ``core/models/assets/tiny-tokenizer``. BPE
training can differ across ``tokenizers`` versions, so the output is committed and loaded by
:func:`voltrl.models.tiny.build_tiny_tokenizer`; rerun this only on purpose::

    .venv/bin/python scripts/make_tiny_tokenizer.py
"""

from __future__ import annotations

import json
import random
import shutil
import string
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

OUT = Path(__file__).resolve().parents[1] / "core/models/assets/tiny-tokenizer"
VOCAB_SIZE = 768
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n' }}
    {%- endif %}
    {{- '<tools>' }}
    {%- for tool in tools %}
        {%- set fn = tool.function if tool.function is defined else tool %}
        {{- fn.name + '(' + ((fn.parameters or {}).properties or {}) | list | join(', ') + ')' }}
        {%- if not loop.last %}{{- ' ' }}{%- endif %}
    {%- endfor %}
    {{- '</tools><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'user' or message.role == 'system'
          or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + (message.content or '') + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
""".strip()

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def corpus(seed: int = 0, n: int = 3000) -> Iterator[str]:
    """Arithmetic questions, answers and calculator-agent transcripts, then printable ASCII."""
    rng = random.Random(seed)
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        op = rng.choice(list(ops))
        expr, value = f"{a} {op} {b}", ops[op](a, b)
        call = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
        yield f"What is {expr}? The answer is {value}."
        yield f"Question: compute {expr}.\nAnswer: {value}"
        yield (
            f"<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n<tools>\n"
            f"{json.dumps(CALC_TOOL)}\n</tools><|im_end|>\n<|im_start|>user\nWhat is {expr}?"
            f"<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>\n"
            f"<|im_start|>user\n<tool_response>\n{value}\n</tool_response><|im_end|>\n"
            f"<|im_start|>assistant\nThe answer is {value}.<|im_end|>\n"
        )
    yield string.printable
    yield " ".join(string.ascii_letters + string.digits + string.punctuation)


def main() -> None:
    """Train, wrap as a transformers tokenizer, and write the fixture."""
    tok = Tokenizer(models.BPE())
    # Digits stand alone, as in Qwen2's tokenizer: a number is the same tokens wherever it
    # appears (in a question, a tool call, a tool result), so copying it is easy to learn.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS),
        min_frequency=2,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    hf.save_pretrained(str(OUT))
    # Portable across transformers 4.x and 5.x: the generic class name, and the chat template
    # inside tokenizer_config.json (older versions do not read chat_template.jinja).
    config_path = OUT / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (OUT / "chat_template.jinja").unlink(missing_ok=True)
    size = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"wrote {OUT} ({len(hf)} tokens, {size} bytes): {sorted(p.name for p in OUT.iterdir())}")


if __name__ == "__main__":
    main()
