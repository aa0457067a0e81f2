"""Reading an OpenAI/vLLM request body: its sampling parameters and its prompt as token ids.

Unsupported or malformed parameters raise :class:`BadRequest`, which the server answers with a
400 and an OpenAI-shaped error.
"""

from __future__ import annotations

from typing import Any

from voltrl.models.chat import ChatError, render_chat
from voltrl.serving.engine import MAX_TOP_LOGPROBS, SamplingParams


class BadRequest(Exception):
    """A request the server answers with a 400 and an OpenAI-shaped error."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def sampling_params(body: dict[str, Any], chat: bool) -> SamplingParams:
    """Sampling parameters of an OpenAI/vLLM request body."""
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name):
            raise BadRequest(f"{name} is not supported by the local engine", name)
    if body.get("repetition_penalty") not in (None, 1, 1.0):
        raise BadRequest("repetition_penalty is not supported", "repetition_penalty")
    if body.get("logit_bias"):
        raise BadRequest("logit_bias is not supported by the local engine", "logit_bias")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise BadRequest("only response_format {'type': 'text'} is supported", "response_format")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list):
        raise BadRequest("stop must be a string or a list of strings", "stop")
    max_tokens = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = body["max_completion_tokens"]
    if not chat and max_tokens is None:
        max_tokens = 16  # the OpenAI (and vLLM) default for completions
    if chat:
        if body.get("top_logprobs") and not body.get("logprobs"):
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        top = body.get("top_logprobs") or 0
    else:
        top = body.get("logprobs") or 0
        if not _is_count(top):
            raise BadRequest(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_default(body, "temperature", 1.0),
        top_p=_default(body, "top_p", 1.0),
        top_k=_default(body, "top_k", 0),
        n=_default(body, "n", 1),
        seed=body.get("seed"),
        stop=stop,
        stop_token_ids=body.get("stop_token_ids") or [],
        ignore_eos=bool(body.get("ignore_eos", False)),
        top_logprobs=top,
        skip_special_tokens=bool(body.get("skip_special_tokens", True)),
    )
    try:
        params.validate()
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return params


def chat_prompt(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """Render the chat template (with ``tools``) and tokenize it."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object", "chat_template_kwargs")
    tok = tokenizer
    try:
        text = render_chat(
            tok,
            body.get("messages"),
            body.get("tools"),
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
            template_kwargs=kwargs,
        )
    except ChatError as e:
        raise BadRequest(str(e)) from e
    return tok.encode(text, add_special_tokens=False)


def completion_prompts(tokenizer: Any, body: dict[str, Any]) -> list[list[int]]:
    """The prompts of a completions request as token ids."""
    for name in ("echo", "suffix"):
        if body.get(name):
            raise BadRequest(f"{name} is not supported by the local engine", name)
    if body.get("best_of") not in (None, body.get("n", 1)):
        raise BadRequest("best_of other than n is not supported", "best_of")
    prompt = body.get("prompt")
    tok = tokenizer
    if isinstance(prompt, str):
        return [tok.encode(prompt, add_special_tokens=False)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [tok.encode(p, add_special_tokens=False) for p in prompt]
        if all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise BadRequest(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists "
        "of token ids",
        "prompt",
    )


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_TOP_LOGPROBS


def _default(body: dict[str, Any], name: str, value: Any) -> Any:
    got = body.get(name)
    return value if got is None else got
