"""Training rows from chat: written conversations, and calls recorded without token ids.

:func:`tokenize_conversation` renders a conversation (OpenAI messages, optional tools) with the
model's chat template and marks the assistant's tokens; :func:`conversation_batch` makes the
conversations rows of a :class:`~voltrl.trajectory.TrainingBatch`. :func:`chat_retokenizer`
turns a call recorded without token ids (a hosted API, a scripted teacher) into the ids the
student would have seen and had to generate: its prompt as the engine renders the request
(:func:`~voltrl.models.chat.render_chat`), its response the rendering of the recorded
assistant message (text and tool calls) up to and including the end-of-turn token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from voltrl.models.chat import ChatError, end_of_turn_id, render_chat
from voltrl.trajectory import (
    Retokenizer,
    TrainingBatch,
    TrajectoryConfig,
    assistant_message,
    collate,
)
from voltrl.types import LLMCall, Trajectory, Transition

Conversation = dict[str, Any]
"""``{"messages": [...], "tools": [...] (optional)}`` in OpenAI chat format."""


def tokenize_conversation(
    tokenizer: Any, conversation: Conversation
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a mask that is 1 on assistant tokens.

    Each assistant turn is the difference between the rendering up to it (with the generation
    prompt) and the rendering including it, up to and including its end-of-turn token: exactly
    what the model would have generated.
    """
    messages, tools = conversation["messages"], conversation.get("tools")

    def ids(msgs: list[dict[str, Any]], gen: bool) -> list[int]:
        out = tokenizer.apply_chat_template(
            msgs, tools=tools, tokenize=True, add_generation_prompt=gen, return_dict=False
        )
        return list(out["input_ids"] if isinstance(out, dict) else out)

    full = ids(messages, False)
    end_of_turn = end_of_turn_id(tokenizer)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(ids(messages[:i], True))
        through = full if i == len(messages) - 1 else ids(messages[: i + 1], False)
        end = len(through)
        if full[:end] != through:
            raise ValueError("the chat template does not render conversations incrementally")
        for k in range(start, min(end, len(full))):
            mask[k] = 1
            if full[k] == end_of_turn:  # what the template adds after it is not generated
                break
    return full, mask


def conversation_batch(tokenizer: Any, conversations: Sequence[Conversation]) -> TrainingBatch:
    """The conversations as training rows, one each: the prompt is what comes before the first
    assistant token, the response the rest, with :func:`tokenize_conversation`'s mask (the
    turns between assistant turns are context, as in a trajectory-mode row)."""
    trajectories = []
    for i, conversation in enumerate(conversations):
        ids, mask = tokenize_conversation(tokenizer, conversation)
        start = mask.index(1) if 1 in mask else len(ids)
        row = Transition(
            prompt_token_ids=ids[:start],
            response_token_ids=ids[start:],
            response_mask=mask[start:],
            reward=0.0,
        )
        trajectories.append(Trajectory(rollout_id=str(i), task_id=str(i), transitions=[row]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return collate(trajectories, TrajectoryConfig(pad_token_id=pad))


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
