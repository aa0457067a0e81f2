"""Chat rendering as the engine does it: OpenAI messages → the model's chat template → ids.

One definition, used where a prompt is rendered: the engine's ``/v1/chat/completions``
(:mod:`.server`) and :func:`chat_retokenizer`, which turns a call recorded without token ids
(a hosted API, a scripted teacher) into the ids the student model would have seen and had to
generate. A re-tokenised call's prompt is exactly what the engine would feed the student for
that request, and its response is the rendering of the recorded assistant message (text and
tool calls) up to and including the end-of-turn token.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from voltrl.trajectory import Retokenizer, assistant_message
from voltrl.types import LLMCall

ROLES = {"system", "developer", "user", "assistant", "tool"}
_TEXT_PARTS = {"text", "input_text", "output_text"}


class ChatError(ValueError):
    """Messages the chat template cannot render (a 400 from the engine)."""


def chat_message(m: Any, i: int) -> dict[str, Any]:
    """An OpenAI chat message as the chat template wants it (string content, system role)."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise ChatError(f"messages[{i}] must be an object with a role in {sorted(ROLES)}")
    out = dict(m)
    out["role"] = "system" if m["role"] == "developer" else m["role"]
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                raise ChatError(f"messages[{i}]: only text content parts are supported")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise ChatError(f"messages[{i}].content must be a string, a list of parts or null")
    out["content"] = content
    calls = m.get("tool_calls")
    if calls is not None and not (
        isinstance(calls, list)
        and all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)
    ):
        raise ChatError(f"messages[{i}].tool_calls must be a list of function calls")
    return out


def render_chat(
    tokenizer: Any,
    messages: Any,
    tools: Any = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The text the chat template makes of ``messages`` (and ``tools``); :class:`ChatError`
    when they are malformed or the template cannot render them."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise ChatError("tools must be a list of objects")
    rendered = [chat_message(m, i) for i, m in enumerate(messages)]
    try:
        return tokenizer.apply_chat_template(
            rendered,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        raise ChatError(f"the chat template could not render these messages: {e}") from e


def end_of_turn_id(tokenizer: Any) -> int:
    """The token that ends an assistant turn: ``<|im_end|>`` when the tokenizer has it, else
    its EOS."""
    token = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(token, int) and token != tokenizer.unk_token_id:
        return token
    return int(tokenizer.eos_token_id)


def chat_retokenizer(tokenizer: Any) -> Retokenizer:
    """A :data:`voltrl.trajectory.Retokenizer` for ``TrajectoryConfig(missing_token_ids=
    "retokenize", retokenizer=...)``: a call recorded without token ids becomes

    - ``prompt_ids``: the request's messages and tools rendered with the generation prompt
      and tokenized, as the engine renders a request;
    - ``response_ids``: the rest of the rendering once the recorded assistant message is
      appended, tokenized, cut after the first end-of-turn token (what the template adds
      after it is not generated).

    The answer is the recorded message's ``content`` and ``tool_calls``; a
    ``reasoning_content`` the API returned beside it is not rendered (the student learns the
    answer, not the reasoning an API shows or hides). Raises :class:`ChatError`, naming the
    call, for a call that is not a chat call (no ``messages``), messages the template cannot
    render, a template that renders the answer's turn so that the prompt is not its prefix,
    or an answer without the end-of-turn token.
    """
    end = end_of_turn_id(tokenizer)

    def retokenize(call: LLMCall) -> tuple[list[int], list[int]]:
        messages = call.request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ChatError(f"call {call.call_id} is not a chat call: it has no messages")
        tools = call.request.get("tools")
        kwargs = call.request.get("chat_template_kwargs") or None
        answer = {"role": "assistant", **_assistant_message(call)}
        try:
            prompt = render_chat(tokenizer, messages, tools, template_kwargs=kwargs)
            full = render_chat(
                tokenizer,
                [*messages, answer],
                tools,
                add_generation_prompt=False,
                template_kwargs=kwargs,
            )
        except ChatError as e:
            raise ChatError(f"call {call.call_id}: {e}") from e
        if not full.startswith(prompt):
            raise ChatError(
                f"call {call.call_id}: the chat template renders the answer's turn differently "
                "from the generation prompt, so the answer cannot be cut out of it"
            )
        response = tokenizer.encode(full[len(prompt) :], add_special_tokens=False)
        if end not in response:
            raise ChatError(
                f"call {call.call_id}: the rendered answer has no end-of-turn token "
                f"({tokenizer.convert_ids_to_tokens(end)!r})"
            )
        return tokenizer.encode(prompt, add_special_tokens=False), response[
            : response.index(end) + 1
        ]

    return retokenize


def _assistant_message(call: LLMCall) -> dict[str, Any]:
    """The recorded answer of a call: its ``content`` and ``tool_calls``."""
    message = assistant_message(call)
    out: dict[str, Any] = {"content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out
