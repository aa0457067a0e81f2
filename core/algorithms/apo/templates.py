"""What APO says to its optimizer and how it reads the answers: the default critique prompts
(:data:`CRITIQUE` of transcripts, :data:`INDUCE` of input/answer pairs) and rewrite prompt,
the runs it quotes, the template it extracts from a rewrite, the placeholders it puts back
(:func:`with_placeholders`), and the guard rails a candidate passes before it is run
(:func:`refusal`)."""

from __future__ import annotations

import json
import re
import string
from collections.abc import Sequence
from typing import Any

from voltrl._redact import without_secrets
from voltrl.resources import PromptTemplate
from voltrl.types import LLMCall

CRITIQUE = PromptTemplate(
    template="""You are improving the prompt template that an AI agent is given. The template \
is between <prompt> tags; its placeholders ({variables}) are filled in for each task.

<prompt>
{template}
</prompt>

Here are some of the agent's runs with this template: the task it was given, what it saw \
and said, and the reward it got (higher is better).

{examples}

Compare the agent's replies with what the tasks expected. In a few sentences, quoting the \
runs, say what the agent got wrong in the low-reward runs, what the high-reward runs did \
right, and what instruction the template lacks. Do not write a new template yet."""
)
"""The default critique prompt: ``{template}``, ``{variables}`` and ``{examples}`` (the runs'
transcripts)."""

INDUCE = PromptTemplate(
    template="""I gave a friend an instruction and some inputs. The friend read the instruction \
and wrote an output for every one of the inputs. Here are the input-output pairs:

{examples}

The instruction was"""
)
"""The default critique prompt when the tasks carry their answers (``APO(answer_key=...)``):
instruction induction (APE, Zhou et al. 2022). ``{examples}`` are the batch's tasks as input and
expected-output pairs; the answer, an instruction that maps the one to the other, is what the
rewrite builds the next template from. Small optimizers that cannot critique a transcript can
still do this."""

REWRITE = PromptTemplate(
    template="""You are improving the prompt template that an AI agent is given. The current \
template:

<prompt>
{template}
</prompt>

What the agent's runs say about it:

{critique}

Write an improved template that fixes what the critique points out: first the instructions \
the agent needs, then its input. Keep every placeholder exactly as written ({variables}), \
where the input goes, and add no other text in curly braces. Answer with the new template \
alone, between <prompt> and </prompt>."""
)
"""The default rewrite prompt: ``{template}``, ``{variables}`` and ``{critique}``."""

_TAGGED = re.compile(r"<prompt>\s*(.*?)\s*</prompt>", re.DOTALL | re.IGNORECASE)
_OPENED = re.compile(r"<prompt>", re.IGNORECASE)
_FENCED = re.compile(r"```[a-zA-Z]*\n(.*?)\n?```", re.DOTALL)


def variables(template: str, engine: str) -> set[str]:
    """The variables ``template`` renders (the names it needs filled in). Raises
    ``ValueError`` when it is not a valid template of ``engine``."""
    if engine == "jinja":
        from jinja2 import TemplateSyntaxError, meta
        from jinja2.sandbox import SandboxedEnvironment

        try:
            return set(meta.find_undeclared_variables(SandboxedEnvironment().parse(template)))
        except TemplateSyntaxError as exc:
            raise ValueError(f"broken jinja syntax: {exc}") from None
    names = set()
    for _, field, _, _ in string.Formatter().parse(template):  # ValueError on a stray brace
        if field is not None:
            if not field or field[0].isdigit():
                raise ValueError("a positional placeholder ({} or {0}) has no name to fill in")
            names.add(re.split(r"[.\[]", field, maxsplit=1)[0])
    return names


def refusal(candidate: str, start: PromptTemplate, seen: Sequence[str]) -> str | None:
    """Why ``candidate`` must not run, or None when it may: empty, broken syntax, a variable
    of the starting template dropped, one added that the agent does not fill in, an f-string
    field that is not a plain ``{name}`` nor one of the starting template's own (an
    attribute, an index, a conversion or a format spec, which may fail to render or reach
    into the value), or a template already tried (``seen``)."""
    if not candidate.strip():
        return "empty template"
    try:
        found = variables(candidate, start.engine)
    except ValueError as exc:
        return f"broken template syntax: {exc}"
    wanted = variables(start.template, start.engine)
    if missing := sorted(wanted - found):
        return f"drops the template variable(s) {', '.join(missing)}"
    if extra := sorted(found - wanted):
        return f"adds the variable(s) {', '.join(extra)}, which the agent does not fill in"
    if start.engine == "f-string":
        own = set(_fields(start.template))
        for field in _fields(candidate):
            name, conversion, spec = field
            if field not in own and not (_NAME.fullmatch(name) and not conversion and not spec):
                shown = (
                    name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
                )
                return f"uses the field {{{shown}}}: only plain {{name}} fields or the start's own"
    if candidate.strip() in {s.strip() for s in seen}:
        return "the same as a template already tried"
    return None


MIN_REPAIRED_WORDS = 3
"""Words a rewrite must have of its own to be repaired: less is a misread answer (``and``,
from "between <prompt> and </prompt>"), refused as it is."""


def with_placeholders(candidate: str, start: PromptTemplate) -> tuple[str, str | None]:
    """``candidate`` with the lines of the starting template that hold the variables it left
    out appended, in the start's order (``Q: {q}``: the label and a format spec kept), and a
    note saying so; unchanged (note None) when it has them all, is not a valid template, has
    fewer than :data:`MIN_REPAIRED_WORDS` words, or left out a variable the start uses only
    inside a block of several lines (a Jinja loop). A small optimizer often writes a good
    instruction and drops the input's placeholder (``Classify the review as positive or
    negative.``): repaired, the instruction can run."""
    try:
        found = variables(candidate, start.engine)
    except ValueError:
        return candidate, None
    missing = variables(start.template, start.engine) - found
    if not missing or len(candidate.split()) < MIN_REPAIRED_WORDS:
        return candidate, None
    lines, left = [], set(missing)
    for line in start.template.splitlines():
        try:
            held = variables(line, start.engine) & left
        except ValueError:  # a line of a block that spans several (Jinja): not appended alone
            continue
        if held:
            lines.append(line.strip())
            left -= held
    if left:  # used only inside a block of several lines (Jinja): no line to put back
        return candidate, None
    note = f"appended {' / '.join(lines)!r} from the start, which the rewrite left out"
    return candidate.rstrip() + "\n\n" + "\n".join(lines), note


_NAME = re.compile(r"[A-Za-z_]\w*")


def _fields(template: str) -> list[tuple[str, str | None, str]]:
    """An f-string template's fields as ``(name, conversion, format spec)``."""
    return [
        (field, conversion, spec or "")
        for _, field, spec, conversion in string.Formatter().parse(template)
        if field is not None
    ]


def extract(answer: str) -> str:
    """The template in a rewrite answer: between ``<prompt>`` tags (the last such block), else
    after an opening tag never closed (an answer cut off by ``max_tokens``), else in a fenced
    code block, else the whole answer."""
    if tagged := _TAGGED.findall(answer):
        return tagged[-1]
    if opened := _OPENED.split(answer)[1:]:
        return opened[-1].strip()
    if fenced := _FENCED.findall(answer):
        return fenced[-1].strip()
    return answer.strip()


def variable_list(template: PromptTemplate) -> str:
    """The starting template's variables as the prompts name them (``{q}, {context}``)."""
    names = sorted(variables(template.template, template.engine))
    if template.engine == "jinja":
        return ", ".join("{{ " + n + " }}" for n in names) or "none"
    return ", ".join("{" + n + "}" for n in names) or "none"


def transcript(calls: Sequence[LLMCall], limit: int) -> str:
    """What the agent saw and said in a rollout, from its last LLM call (the conversation
    up to then, and the reply), at most ``limit`` characters (the middle left out)."""
    if not calls:
        return "(the agent made no LLM call)"
    last = max(calls, key=lambda c: c.sequence_id or 0)
    lines = [f"{m.get('role', '?')}: {_text(m)}" for m in last.request.get("messages") or []]
    if "prompt" in last.request:
        lines.append(f"prompt: {last.request['prompt']}")
    lines.append(f"assistant: {_text(_reply(last))}")
    text = "\n".join(lines)
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]}\n[...]\n{text[-(limit - head) :]}"


def _reply(call: LLMCall) -> dict[str, Any]:
    choices = call.response.get("choices") or []
    choice = next((c for c in choices if c.get("index") == call.choice_index), None)
    choice = choice or (choices[0] if choices else {})
    return choice.get("message") or {"content": choice.get("text", "")}


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    text = str(content or "")
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        text += f"\n[tool call {function.get('name')}({function.get('arguments', '')})]"
    return text


def example_block(
    index: int, reward: float | None, calls: Sequence[LLMCall], limit: int, task: Any = None
) -> str:
    """One quoted rollout for the critique prompt: its task's input (JSON, secrets redacted, at
    most a third of ``limit``) when given, then its transcript, ``limit`` characters in all."""
    shown = "failed" if reward is None else json.dumps(round(reward, 3))
    if task is None:
        return f"--- run {index} (reward {shown}) ---\n{transcript(calls, limit)}"
    given = json.dumps(without_secrets(task), ensure_ascii=False, default=str)[: limit // 3]
    text = transcript(calls, limit - len(given))
    return f"--- run {index} (reward {shown}) ---\ntask: {given}\n{text}"


def pair_block(task: dict[str, Any], answer_key: str, limit: int) -> str:
    """A task as an input and expected-output pair (:data:`INDUCE`): its fields other than
    ``answer_key`` (a single field's value alone, else ``name: value`` lines), then the answer;
    each part at most ``limit`` characters."""
    task = without_secrets(task)
    rest = {k: v for k, v in task.items() if k != answer_key}
    if len(rest) == 1:
        given = _plain(next(iter(rest.values())))
    else:
        given = "\n".join(f"{k}: {_plain(v)}" for k, v in rest.items())
    return f"Input: {given[:limit]}\nOutput: {_plain(task[answer_key])[:limit]}"


def _plain(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def same_rewards(rewards: Sequence[float | None]) -> str | None:
    """A line saying every quoted run got the same reward (then there are no "high-reward
    runs" to learn from, which a small optimizer otherwise invents), or None."""
    if len(rewards) > 1 and len(set(rewards)) == 1:
        shown = "failed" if rewards[0] is None else json.dumps(round(rewards[0], 3))
        return f"Every one of these runs got the same reward ({shown}): none did better yet."
    return None
