"""A scripted teacher for the unit-conversion agent (``samples/teacher_server.py`` serves it).

The policy reads the question from the request's first user message (``How many feet are in
5.2 inches?``, the template of ``units.make_tasks``) and plays two turns:

1. the tool call ``convert({"value": 5.2, "from_unit": "in", "to_unit": "ft"})`` (always the
   keys in this order, the value as the question writes it, the symbols of ``units.UNITS``);
2. once the tool's result is back (a ``tool`` message after the last assistant message), the
   final answer ``5.2 inches is 0.433333 feet.``: the question's number and unit names, and the
   tool's number copied as it is (so the answer's last number is the result).

Once per episode (the rng is the same for every call of an episode, and every call draws the
same numbers in the same order) it decides whether and how to err; the output has the same
shape whether it errs or not. Rough rates:

- about 62%: right, as above (about 1% of the tasks are scored wrong even so: ``make_tasks``
  rounds the expected answer to 6 decimals, so an answer below about 1e-4 is off by over 1%).
- about 12%, *no tool*: answers at once from memory, in the same sentence, with a wrong factor
  (the inverse of the right factor half the time, the right one off by a factor of ten the
  other half).
- about 11%, *swapped units*: calls ``convert`` with ``from_unit`` and ``to_unit`` swapped, and
  reports the tool's (wrong) number.
- about 9%, *misread number*: calls ``convert`` with a misread value (``5.2`` as ``52``, ``153``
  as ``135``, ``7`` as ``70``), and reports the tool's number for the question's value.
- about 6%, *copied the wrong number*: calls ``convert`` rightly, then answers with the
  question's number instead of the tool's (``5.2 inches is 5.2 feet.``).

Every mistake is off by more than the reward's 1%. Requests it does not expect never raise: a
request without the ``convert`` tool is answered at once (from the unit table, or with the
episode's wrong number); a question it cannot parse, or a tool result that is not a number, is
answered with a plausible wrong number.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent


def _load_units() -> ModuleType:
    """``units.py`` of this sample, under a name of its own (no clash on ``sys.path``)."""
    spec = importlib.util.spec_from_file_location("agent_service_units", HERE / "units.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


units = _load_units()

TOOL = "convert"
#: The episode's kinds, with their probabilities (drawn in this order).
KINDS: tuple[tuple[str, float], ...] = (
    ("right", 0.62),
    ("no_tool", 0.12),
    ("swap", 0.11),
    ("misread", 0.09),
    ("echo", 0.06),
)
SYMBOLS: dict[str, str] = {name: symbol for symbol, name in units.NAMES.items()}
QUESTION = re.compile(r"How many ([A-Za-z]+) are in (-?\d+(?:\.\d+)?) ([A-Za-z]+)\?")


class Question(NamedTuple):
    """A parsed question: ``How many {to_name} are in {value_text} {from_name}?``."""

    value_text: str
    from_name: str
    to_name: str

    @property
    def value(self) -> float:
        """The value as a number."""
        return float(self.value_text)

    @property
    def from_unit(self) -> str:
        """The symbol of the unit converted from."""
        return SYMBOLS[self.from_name]

    @property
    def to_unit(self) -> str:
        """The symbol of the unit converted to."""
        return SYMBOLS[self.to_name]

    def sentence(self, number: str) -> str:
        """The final answer with ``number`` as the result."""
        return f"{self.value_text} {self.from_name} is {number} {self.to_name}."


class Episode(NamedTuple):
    """What the teacher decided for an episode: its kind and the draws its mistakes use."""

    kind: str
    memory_draw: float
    guess: float


def draw_episode(rng: random.Random) -> Episode:
    """The episode's decisions; the same draws, in the same order, on every call."""
    u, memory_draw, guess = rng.random(), rng.random(), rng.uniform(1.0, 500.0)
    kind, total = KINDS[-1][0], 0.0
    for name, p in KINDS:
        total += p
        if u < total:
            kind = name
            break
    return Episode(kind, memory_draw, guess)


def _text(content: Any) -> str:
    """A message's content as text (a string, a list of parts, or nothing)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") if isinstance(p, dict) else str(p) for p in content]
        return "".join(parts)
    return "" if content is None else json.dumps(content)


def parse_question(messages: list[dict[str, Any]]) -> Question | None:
    """The question of the first user message, or ``None`` when it is not one of ours."""
    for message in messages:
        if message.get("role") == "user":
            found = QUESTION.search(_text(message.get("content")))
            if found is None:
                return None
            to_name, value_text, from_name = found.groups()
            to_name, from_name = to_name.lower(), from_name.lower()
            if to_name not in SYMBOLS or from_name not in SYMBOLS:
                return None
            return Question(value_text, from_name, to_name)
    return None


def tool_result(messages: list[dict[str, Any]]) -> str | None:
    """The content of the last tool message after the last assistant message, if any."""
    result = None
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            result = None
        elif role == "tool":
            result = _text(message.get("content")).strip()
    return result


def has_tool(request: dict[str, Any]) -> bool:
    """Whether the request offers the ``convert`` tool."""
    for tool in request.get("tools") or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(function, dict) and function.get("name") == TOOL:
            return True
    return False


def fmt(number: float) -> str:
    """A number the way the tool writes it (6 significant digits)."""
    return f"{number:.6g}"


def misread(value_text: str) -> str:
    """A misreading of the question's number: the decimal point dropped (``5.2`` → ``52``), the
    last two digits swapped (``153`` → ``135``), or a zero added (``7`` → ``70``)."""
    if "." in value_text:
        return value_text.replace(".", "", 1).lstrip("0") or "0"
    if len(value_text) >= 2 and value_text[-1] != value_text[-2]:
        return value_text[:-2] + value_text[-1] + value_text[-2]
    return value_text + "0"


def _number(text: str) -> int | float:
    """A number for the tool call's JSON: ``12`` stays an integer, ``5.2`` a float."""
    return int(text) if re.fullmatch(r"-?\d+", text) else float(text)


def _off(got: float, want: float) -> bool:
    """Whether ``got`` misses ``want`` by more than the reward's 1%."""
    return abs(got - want) > 0.01 * max(abs(want), 1e-9)


def memory_answer(question: Question, episode: Episode) -> float:
    """A wrong answer from memory: the inverse factor, or the right one off by ten."""
    right = units.convert_units(question.value, question.from_unit, question.to_unit)
    factor = right / question.value if question.value else 1.0
    if episode.memory_draw < 0.5 and factor:
        wrong = question.value / factor
    elif episode.memory_draw < 0.75:
        wrong = right * 10
    else:
        wrong = right / 10
    return wrong if _off(wrong, right) else right * 10


def call(value: int | float, from_unit: str, to_unit: str) -> dict[str, Any]:
    """The assistant message calling ``convert``."""
    arguments = {"value": value, "from_unit": from_unit, "to_unit": to_unit}
    return {"content": None, "tool_calls": [{"name": TOOL, "arguments": arguments}]}


def teacher_reply(request: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The assistant message for a chat-completions request of the converter agent."""
    episode = draw_episode(rng)
    messages = [m for m in request.get("messages") or [] if isinstance(m, dict)]
    question = parse_question(messages)
    if question is None:
        return {"content": f"The answer is {fmt(round(episode.guess, 2))}."}

    result = tool_result(messages)
    if result is not None:  # the tool answered: report its number
        if episode.kind == "echo":
            return {"content": question.sentence(question.value_text)}
        if units.last_number(result) is None or not re.fullmatch(r"[-+.\deE]+", result):
            return {"content": question.sentence(fmt(memory_answer(question, episode)))}
        return {"content": question.sentence(result)}

    if not has_tool(request):  # no tool to call: answer at once
        if episode.kind == "right":
            number = units.convert_units(question.value, question.from_unit, question.to_unit)
        else:
            number = memory_answer(question, episode)
        return {"content": question.sentence(fmt(number))}

    if episode.kind == "no_tool":
        return {"content": question.sentence(fmt(memory_answer(question, episode)))}
    value: int | float = _number(question.value_text)
    if episode.kind == "swap":
        return call(value, question.to_unit, question.from_unit)
    if episode.kind == "misread":
        value = _number(misread(question.value_text))
    return call(value, question.from_unit, question.to_unit)
