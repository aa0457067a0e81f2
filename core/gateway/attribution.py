"""Attribution: from a request's URL, headers and body to the call it is, of which rollout,
attempt and agent.

Agents call ``/rollouts/{rollout_id}/attempts/{attempt_id}[/agents/{agent_name}]/v1/...``
(what :meth:`voltrl.resources.LLM.scoped` builds), or plain ``/v1/...`` with an
``x-rollout-id`` header (or a configurable trace header), an optional ``x-attempt-id`` (default:
the rollout's running attempt) and an optional ``x-agent-name``. Each step here raises
:class:`~voltrl.gateway.errors.GatewayHTTPError` with what the client got wrong, before anything
is forwarded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from voltrl.errors import NotFoundError
from voltrl.gateway._asgi import ASGIReceive
from voltrl.gateway.errors import GatewayHTTPError
from voltrl.gateway.records import Call
from voltrl.store.base import Store

_KNOWN_LIMIT = 100_000  # (rollout, attempt) pairs remembered as valid

_KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}

_UNSERVED_API_ADVICE = (
    ": the VoltRL gateway serves /v1/chat/completions and /v1/completions only (not the "
    "Responses API). With the OpenAI Agents SDK use voltrl.adapters.openai_agents.model(llm), "
    "a chat-completions model, or call "
    'agents.set_default_openai_api("chat_completions") before running the agent.'
)


@dataclass(slots=True)
class Target:
    """What a request's URL names: the OpenAI endpoint and, in the scoped form, the rollout,
    attempt and agent (None where the URL does not say)."""

    path: str  # below the mount point, still percent-encoded
    endpoint: str  # decoded, e.g. "/v1/chat/completions"
    rollout_id: str | None = None
    attempt_id: str | None = None
    agent_name: str | None = None


def target_of(scope: dict[str, Any]) -> Target:
    """Parse the request's URL; a malformed ``/rollouts/...`` path is a 404."""
    path = _route_path(scope)
    if not path.startswith("/rollouts/"):
        return Target(path, unquote(path))
    parts = path.split("/")
    # "", "rollouts", rid, "attempts", aid, ["agents", name,] "v1", endpoint...
    if len(parts) < 7 or parts[3] != "attempts":
        raise GatewayHTTPError(404, f"no route {path!r}", type="not_found_error")
    rollout_id, attempt_id, agent_name = unquote(parts[2]), unquote(parts[4]), None
    rest = parts[5:]
    if rest[0] == "agents" and len(rest) >= 3:
        agent_name, rest = unquote(rest[1]), rest[2:]
    return Target(path, unquote("/" + "/".join(rest)), rollout_id, attempt_id, agent_name)


def call_kind(target: Target, method: str) -> str:
    """``"chat"`` or ``"completions"``: the proxied call ``target`` names (404 for any other
    endpoint, with advice for an OpenAI one the gateway does not serve; 405 unless POST)."""
    kind = _KINDS.get(target.endpoint)
    if kind is None:
        message = f"no route {target.path!r}"
        if target.endpoint.startswith("/v1/"):
            message += _UNSERVED_API_ADVICE
        raise GatewayHTTPError(404, message, type="not_found_error")
    if method != "POST":
        raise GatewayHTTPError(405, f"{method} is not allowed on {target.endpoint}")
    return kind


def attribute(
    target: Target, headers: dict[str, str], trace_header: str
) -> tuple[str, str | None, str | None]:
    """``(rollout_id, attempt_id, agent_name)`` of a call: from the URL, else from the headers
    (``x-rollout-id`` or ``trace_header``; 400 without either). The attempt is None when the
    call leaves it to the rollout's running one."""
    rollout_id, attempt_id = target.rollout_id, target.attempt_id
    if rollout_id is None:
        rollout_id = headers.get("x-rollout-id") or headers.get(trace_header)
        attempt_id = headers.get("x-attempt-id")
        if not rollout_id:
            raise GatewayHTTPError(
                400,
                "no rollout id: call /rollouts/{rollout_id}/attempts/{attempt_id}/v1/... or "
                f"send an x-rollout-id (or {trace_header}) header",
            )
    return rollout_id, attempt_id, target.agent_name or headers.get("x-agent-name")


async def read_body(headers: dict[str, str], receive: ASGIReceive, limit: int) -> bytes:
    """The request body; over ``limit`` bytes (declared or sent) is a 413."""
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayHTTPError(
            413, f"request body of {declared} bytes is over the {limit}-byte limit"
        )
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise GatewayHTTPError(400, "client disconnected before sending its body")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayHTTPError(413, f"request body is over the {limit}-byte limit")
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def parse_call(
    kind: str, raw: bytes, rollout_id: str, attempt_id: str, agent_name: str | None
) -> Call:
    """The call a request body makes (400 unless it is a valid one of ``kind``), with what the
    client asked to get back."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise GatewayHTTPError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise GatewayHTTPError(400, "request body must be a JSON object")
    if kind == "chat":
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise GatewayHTTPError(400, "'messages' must be a non-empty list")
        wants_logprobs = bool(body.get("logprobs"))
    else:
        if not isinstance(body.get("prompt"), str | list):
            raise GatewayHTTPError(400, "'prompt' must be a string or a list")
        wants_logprobs = body.get("logprobs") is not None
    n = body.get("n", 1)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise GatewayHTTPError(400, "'n' must be a positive integer")
    opts = body.get("stream_options")
    return Call(
        kind=kind,
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        agent_name=agent_name,
        body=body,
        wants_ids=bool(body.get("return_token_ids")),
        wants_logprobs=wants_logprobs,
        wants_usage=isinstance(opts, dict) and bool(opts.get("include_usage")),
    )


class AttemptCheck:
    """Checks a call's attempt against the store: it must be one of the rollout's, or, when
    the call names none, the rollout's running attempt is taken. Attempts found valid are
    remembered, so the store is asked once per attempt, not once per call."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._known: dict[tuple[str, str], None] = {}
        self._modes: dict[str, str] = {}

    async def resolve(self, rollout_id: str, attempt_id: str | None) -> str:
        """The call's attempt id; an unknown rollout or attempt (or no running attempt to
        default to) is a 404."""
        if attempt_id and (rollout_id, attempt_id) in self._known:
            return attempt_id
        try:
            attempts = await self.store.get_attempts(rollout_id)
        except NotFoundError:
            raise GatewayHTTPError(
                404, f"unknown rollout {rollout_id!r}", type="not_found_error"
            ) from None
        if attempt_id is None:
            running = [a.attempt_id for a in attempts if a.status == "running"]
            if not running:
                raise GatewayHTTPError(
                    404,
                    f"rollout {rollout_id!r} has no running attempt; send x-attempt-id",
                    type="not_found_error",
                )
            return running[-1]
        if all(a.attempt_id != attempt_id for a in attempts):
            raise GatewayHTTPError(
                404,
                f"unknown attempt {attempt_id!r} of rollout {rollout_id!r}",
                type="not_found_error",
            )
        if len(self._known) >= _KNOWN_LIMIT:
            self._known.clear()
        self._known[(rollout_id, attempt_id)] = None
        return attempt_id

    async def mode(self, rollout_id: str) -> str:
        """The rollout's mode (``train``, ``val``, ``dev``...), asked of the store once per
        rollout (the call's attempt was resolved already)."""
        mode = self._modes.get(rollout_id)
        if mode is None:
            mode = (await self.store.get_rollout(rollout_id)).mode
            if len(self._modes) >= _KNOWN_LIMIT:
                self._modes.clear()
            self._modes[rollout_id] = mode
        return mode


def _route_path(scope: dict[str, Any]) -> str:
    """The path below the app's mount point (Starlette's ``Mount`` keeps it in root_path),
    still percent-encoded, so that a segment holding an encoded ``/`` (an agent named
    ``team/role``) stays one segment; :func:`target_of` decodes each."""
    raw = scope.get("raw_path")
    path: str = raw.decode("latin-1") if raw else quote(scope["path"])
    root: str = quote(scope.get("root_path", ""))
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("/", ""):
        path = path[len(root) :] or "/"
    return path.rstrip("/") or "/"
