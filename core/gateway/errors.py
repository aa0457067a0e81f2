"""The gateway's errors: what it answers instead of forwarding, and how a backend's refusal
reaches the agent (a prompt over the model's context as OpenAI's ``context_length_exceeded``,
whichever backend said it)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence


class GatewayHTTPError(Exception):
    """A request the gateway answers with an OpenAI-shaped error instead of forwarding."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        headers: Sequence[tuple[bytes, bytes]] = (),
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type, list(headers)
        self.code, self.param = code, param

    def body(self) -> bytes:
        """The error as OpenAI clients expect it: ``{"error": {"message", "type", ...}}``."""
        err = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code or self.status,
        }
        return json.dumps({"error": err}).encode()


_CONTEXT_OVERFLOW = re.compile(
    r"context[ _]length|maximum context|model's context|context of \d+|context size|"
    r"prompt is too long|exceeds the context",
    re.IGNORECASE,
)


def refusal(error: GatewayHTTPError) -> GatewayHTTPError:
    """A backend's 4xx as the agent gets it: a request over the model's context (the
    prompt, or the prompt with ``max_tokens``) gets OpenAI's ``context_length_exceeded`` code,
    whichever backend said it (vLLM, LocalRL's engine, llama.cpp, a hosted API), with the
    backend's status; any other refusal passes unchanged."""
    if error.code == "context_length_exceeded" or _CONTEXT_OVERFLOW.search(error.message):
        return GatewayHTTPError(
            error.status,
            f"the request does not fit the model's context: {error.message}",
            code="context_length_exceeded",
        )
    return error


def backend_error(status: int, text: str) -> GatewayHTTPError:
    """A non-retryable backend answer, passed on with its status and message."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            code = err.get("code") if isinstance(err.get("code"), str) else None
            kind = err.get("type") or "api_error"
            return GatewayHTTPError(status, err["message"], type=kind, code=code)
        if isinstance(err, str):
            return GatewayHTTPError(status, err, type="api_error")
    return GatewayHTTPError(
        status, f"backend answered HTTP {status}: {text[:500]}", type="api_error"
    )


def is_context_overflow(error: BaseException) -> bool:
    """Whether ``error``, or an exception that caused it, is a backend's refusal of a request
    over the model's context: the gateway's ``context_length_exceeded`` code, or (a client
    calling a backend directly) a 400 whose message says so. For agents that end an episode,
    or trim their history, on it."""
    seen: BaseException | None = error
    while seen is not None:
        if getattr(seen, "code", None) == "context_length_exceeded":
            return True
        if getattr(seen, "status_code", None) == 400 and _CONTEXT_OVERFLOW.search(str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
