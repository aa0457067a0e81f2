"""Chat rendering as the engine does it: OpenAI messages → the model's chat template → text.

One definition, used wherever a prompt is rendered: the engine's ``/v1/chat/completions``
(:mod:`voltrl.serving.openai_api`) and the re-tokenisation of calls recorded without token
ids (:func:`voltrl.algorithms.local.conversations.chat_retokenizer`), so a re-tokenised call's
prompt is exactly what the engine would feed the model for that request.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

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
