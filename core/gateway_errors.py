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


REFUSED_SPAN = "gateway.refused"
"""The name of the span recording a call the backend refused with a 4xx."""

_CONTEXT_OVERFLOW = re.compile(
    r"context[ _](length|window)|maximum context|model's context|context of \d+|"
    r"prompt is too long|too many tokens|exceeds the context",
    re.IGNORECASE,
)


def refusal(error: GatewayHTTPError) -> GatewayHTTPError:
    """A backend's 4xx as the agent gets it: a prompt over the model's context becomes
    OpenAI's ``context_length_exceeded`` (400, param ``messages``), whichever backend said it
    (vLLM, LocalRL's engine, a hosted API); any other refusal passes unchanged."""
    if error.code == "context_length_exceeded" or _CONTEXT_OVERFLOW.search(error.message):
        return GatewayHTTPError(
            400,
            f"the prompt does not fit the model's context: {error.message}",
            code="context_length_exceeded",
            param="messages",
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
