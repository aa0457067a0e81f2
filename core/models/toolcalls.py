"""Tool calls in a model's decoded text, in the format the model writes them, as OpenAI
``tool_calls``.

Small models write calls in several formats, so the parser is chosen per model, as vLLM's
``--tool-call-parser`` is. Each parser is a plain function ``parse(text, names) -> (content,
calls)`` in :data:`TOOL_PARSERS`:

- ``"hermes"``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5,
  SmolLM2 through VoltRL's template); an unterminated last tag counts.
- ``"json"``: bare or fenced (```` ```json ````) JSON objects with ``name`` and ``arguments``
  (or ``parameters``), one or several (a list, or one after another), at the end of the reply
  (Qwen2.5-Coder, Llama 3's JSON calls; vLLM's ``llama3_json``).
- ``"pythonic"``: a Python list of calls with keyword arguments, ``[f(a=1), g(b="x")]``
  (Llama 3.2, vLLM's ``pythonic``), bare or in a ```` ```python ```` fence.

``"auto"`` tries them in :data:`AUTO_ORDER` (``hermes``, ``json``, ``pythonic``) and takes
the first that finds a call.

Rules every parser keeps: calls are parsed from the decoded text only (the sampled token ids
are recorded as they are); the text before the first call stays the content (right-stripped,
``None`` when empty); a reply that is not entirely well-formed calls after that content is no
call at all (malformed JSON, a positional argument, text after the calls...) and comes back
whole as content. A parser never raises: :func:`parse_tool_calls` turns any failure into "no
call". A Hermes tag is an explicit call whatever its name (the agent's framework tells the
model an unknown tool does not exist, which is something to learn from); untagged JSON or a
Python list only counts as calls when every name is one of the request's tools, because
ordinary answers look like them (``{"name": "Ada", "arguments": ...}`` as data, a list in
code).

:class:`ToolStream` streams a choice's content while holding back what may turn out to be a
call.
"""

from __future__ import annotations

import ast
import json
import math
import re
import uuid
from collections.abc import Callable, Collection
from typing import Any

Calls = list[dict[str, Any]]
ToolParser = Callable[[str, Collection[str] | None], tuple[str | None, Calls]]
"""``parse(text, names)``: the content before the calls and the OpenAI ``tool_calls``, or
``(text, [])``; ``names``: the request's tool names (None: any name)."""

DEFAULT_TOOL_PARSER = "hermes"
"""The parser of a model that names none (a directory or a hub model): today's format."""

_TOOL_OPEN = "<tool_call>"
_TOOL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
_FENCE = "```"
# Where an untagged call may begin: the first character of a line, after indentation.
_JSON_START = re.compile(r"^[ \t]*(?=[\[{`])", re.MULTILINE)
_PYTHON_START = re.compile(r"^[ \t]*(?=[\[`])", re.MULTILINE)
_JSON_FENCES = ("", "json")
_PYTHON_FENCES = ("", "python", "py")
_DECODER = json.JSONDecoder()


# ---- the parsers -------------------------------------------------------------------------------
def parse_hermes(text: str, names: Collection[str] | None = None) -> tuple[str | None, Calls]:
    """Hermes tags: each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` is a
    call (an unterminated last one too), whatever its name; if any is malformed, nothing is."""
    start = text.find(_TOOL_OPEN)
    if start < 0:
        return text, []
    calls = []
    for match in _TOOL_RE.finditer(text):
        raw = match.group(1) if match.group(1) is not None else match.group(2)
        try:
            obj = json.loads(raw)
        except ValueError:
            return text, []
        call = _json_call(obj, None, need_arguments=False)
        if call is None:
            return text, []
        calls.append(call)
    return text[:start].rstrip() or None, calls


def parse_json(text: str, names: Collection[str] | None = None) -> tuple[str | None, Calls]:
    """Bare or fenced JSON calls ending the reply: from the start of some line to the end,
    only JSON values (objects, or lists of objects), each fenced (```` ``` ```` or
    ```` ```json ````; a last fence may be unclosed, as a reply cut short leaves it) or bare,
    separated by white space, ``,`` or ``;``. Each object needs a
    ``name`` among ``names`` and ``arguments`` (or ``parameters``): an object or a JSON string
    of one."""
    for start in _JSON_START.finditer(text):
        if _in_fence(text, start.start()):
            continue
        values = _json_values(text, start.end())
        if not values:
            continue
        objects = [o for v in values for o in (v if isinstance(v, list) else [v])]
        calls = [_json_call(o, names, need_arguments=True) for o in objects]
        if objects and all(calls):
            return text[: start.start()].rstrip() or None, [c for c in calls if c]
    return text, []


def parse_pythonic(text: str, names: Collection[str] | None = None) -> tuple[str | None, Calls]:
    """A Python list of calls ending the reply, ``[f(a=1), g(b="x")]``, bare or fenced (````
    ```python ````): keyword arguments only, each a literal (``true``/``false``/``null`` read as
    JSON's); every name among ``names``."""
    for start in _PYTHON_START.finditer(text):
        if _in_fence(text, start.start()):
            continue
        body = _unfenced(text[start.end() :].strip(), _PYTHON_FENCES)
        if body is None or not (body.startswith("[") and body.endswith("]")):
            continue
        try:
            node = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        if not isinstance(node, ast.List) or not node.elts:
            continue
        calls = [_python_call(e, names) for e in node.elts]
        if all(calls):
            return text[: start.start()].rstrip() or None, [c for c in calls if c]
    return text, []


TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": parse_hermes,
    "json": parse_json,
    "pythonic": parse_pythonic,
}
"""Every tool-call parser, by the name a model, ``--tool-parser`` or ``serving.tool_parser``
gives it."""

AUTO_ORDER: tuple[str, ...] = ("hermes", "json", "pythonic")
"""The order ``"auto"`` tries the parsers in: explicit tags first, then the untagged formats."""

TOOL_PARSER_CHOICES: tuple[str, ...] = ("auto", *TOOL_PARSERS)
"""Every name a parser may be chosen by."""


def checked_tool_parser(name: Any) -> str:
    """``name`` if it names a parser (or ``"auto"``), else a ``ValueError`` listing them."""
    if name not in TOOL_PARSER_CHOICES:
        choices = ", ".join(TOOL_PARSER_CHOICES)
        raise ValueError(f"unknown tool parser {name!r} (choose one of: {choices})")
    return str(name)


def parse_tool_calls(
    text: str, parser: str = DEFAULT_TOOL_PARSER, tools: Any = None
) -> tuple[str | None, Calls]:
    """Split a reply's decoded ``text`` into content and OpenAI ``tool_calls`` with ``parser``
    (a :data:`TOOL_PARSERS` name or ``"auto"``); ``tools``: the request's tools (None: any
    name counts). Each call gets a fresh id and JSON-string arguments. Never raises: a failure
    is no call, ``(text, [])``."""
    names = tool_names(tools)
    for name in AUTO_ORDER if parser == "auto" else (checked_tool_parser(parser),):
        try:
            content, calls = TOOL_PARSERS[name](text, names)
        except Exception:  # a parser's bug must not fail the reply: the text stays content
            continue
        if calls:
            return content, calls
    return text, []


def tool_names(tools: Any) -> frozenset[str] | None:
    """The function names of a request's ``tools`` (None when it gives no list)."""
    if not isinstance(tools, list):
        return None
    return frozenset(
        t["function"]["name"]
        for t in tools
        if isinstance(t, dict)
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
    )


def default_tool_parser(model: Any) -> str:
    """The parser of what a ``model`` argument names: a packaged model's
    (:attr:`~voltrl.models.packaged.PackagedModel.tool_parser`), else
    :data:`DEFAULT_TOOL_PARSER`."""
    from voltrl.models.packaged import PACKAGED_MODELS

    spec = PACKAGED_MODELS.get(model) if isinstance(model, str) else None
    return spec.tool_parser if spec is not None else DEFAULT_TOOL_PARSER


# ---- pieces ------------------------------------------------------------------------------------
def _new_call(name: str, arguments: str) -> dict[str, Any]:
    fn = {"name": name, "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": fn}


def _json_call(
    obj: Any, names: Collection[str] | None, *, need_arguments: bool
) -> dict[str, Any] | None:
    """The OpenAI call a ``{"name", "arguments"}`` object is (``{"type": "function",
    "function": {...}}`` too), or None."""
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = obj["function"]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    if key is None and need_arguments:
        return None
    args = obj[key] if key else {}
    if isinstance(args, str):
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except ValueError:
            return None
    elif isinstance(args, dict):
        args = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return _new_call(obj["name"], args)


def _json_values(text: str, i: int, *, fenced: bool = True) -> list[Any] | None:
    """The JSON values that make up ``text[i:]`` entirely (fenced ones too when ``fenced``),
    or None."""
    values: list[Any] = []
    separated = True
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] in ",;" and not separated:
            i, separated = i + 1, True
            continue
        if i == len(text):
            return values
        if fenced and text.startswith(_FENCE, i):
            end = text.find(_FENCE, i + len(_FENCE))
            end = len(text) if end < 0 else end + len(_FENCE)  # a last fence may be unclosed
            inner = _unfenced(text[i:end], _JSON_FENCES)
            got = None if inner is None else _json_values(inner, 0, fenced=False)
            if not got:
                return None
            values += got
            i = end
        else:
            try:
                value, i = _DECODER.raw_decode(text, i)
            except ValueError:
                return None
            values.append(value)
        separated = False


def _unfenced(text: str, languages: tuple[str, ...]) -> str | None:
    """The inside of ``text`` if it is one fence of one of ``languages``, closed or (cut
    short) not; a text that opens with no fence is itself; else None."""
    if not text.startswith(_FENCE):
        return text
    head, _, rest = text.partition("\n")
    if head[len(_FENCE) :].strip().lower() not in languages:
        return None
    rest = rest.rstrip()
    inner = rest[: -len(_FENCE)] if rest.endswith(_FENCE) else rest
    return None if _FENCE in inner else inner.strip()


def _in_fence(text: str, at: int) -> bool:
    """Whether ``at`` is inside a fence opened before it (a call starts at the fence)."""
    return text.count(_FENCE, 0, at) % 2 == 1


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _python_call(node: ast.expr, names: Collection[str] | None) -> dict[str, Any] | None:
    """The OpenAI call ``f(a=1, b="x")`` is, or None (positional or ``**`` arguments,
    non-literal values, a name not among ``names``)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if names is not None and node.func.id not in names:
        return None
    args: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None
        try:
            args[keyword.arg] = _literal(keyword.value)
        except ValueError:
            return None
    try:
        arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return None
    return _new_call(node.func.id, arguments)


def _literal(node: ast.expr) -> Any:
    """A JSON value from a Python literal (``true``, ``false``, ``null`` as JSON's)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | bool | None):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("not a JSON number")
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        keys = [_literal(k) for k in node.keys if k is not None]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a dict key that is not a string")
        return dict(zip(keys, (_literal(v) for v in node.values), strict=True))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("a sign before a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"not a literal: {type(node).__name__}")


# ---- streaming ---------------------------------------------------------------------------------
def _held_from(parser: str, text: str) -> int:
    """Where in ``text`` (so far) a call in ``parser``'s format may begin: content from
    there on is held back until the reply ends. Never after the start of a call the parser
    finds in the finished reply."""
    if parser == "auto":
        return min(_held_from(name, text) for name in AUTO_ORDER)
    if parser == "hermes":
        start = text.find(_TOOL_OPEN)
        return start if start >= 0 else len(text) - _partial_suffix(text)
    pattern = _JSON_START if parser == "json" else _PYTHON_START
    start = pattern.search(text)
    return start.end() if start else len(text)


class ToolStream:
    """Streams a choice's content while holding back what may turn out to be a tool call.

    With ``tools``, the text from where a call in ``parser``'s format may begin (a Hermes tag,
    a line opening with ``{``, ``[`` or a fence) is held until the reply ends; then it is
    parsed as a whole reply is, and what is not a call is sent as content. The content sent
    is the whole reply's content, so a streamed reply says what an unstreamed one does.
    """

    def __init__(
        self, tools: bool, parser: str = DEFAULT_TOOL_PARSER, request_tools: Any = None
    ) -> None:
        self.tools, self.text, self.sent, self.in_call = tools, "", 0, False
        self.parser, self.request_tools = checked_tool_parser(parser), request_tools

    def feed(self, text: str, final: bool) -> tuple[str, Calls]:
        """New content to send, and the parsed tool calls once ``final``."""
        if not self.tools:
            return text, []
        self.text += text
        if final:
            content, calls = parse_tool_calls(self.text, self.parser, self.request_tools)
            end = len(content or "") if calls else len(self.text)
            out, self.sent = self.text[self.sent : max(end, self.sent)], end
            return out, calls
        if not self.in_call:
            safe = _held_from(self.parser, self.text)
            self.in_call = safe < len(self.text) - _partial_suffix(self.text)
            end = len(self.text[:safe].rstrip())
            if end > self.sent:
                out, self.sent = self.text[self.sent : end], end
                return out, []
        return "", []


def _partial_suffix(text: str) -> int:
    """Length of the longest end of ``text`` that begins ``<tool_call>``."""
    for k in range(min(len(_TOOL_OPEN) - 1, len(text)), 0, -1):
        if _TOOL_OPEN.startswith(text[-k:]):
            return k
    return 0
