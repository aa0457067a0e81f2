"""Checking the OpenAI-compatible endpoint a run will call, before the run starts: it answers,
and it serves the model asked for."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from voltrl.errors import EndpointUnreachableError, VoltRLError

if TYPE_CHECKING:
    from voltrl.resources import LLM


def check_endpoint(
    endpoint: str, api_key: str, model: str | None = None, timeout_s: float = 5.0
) -> None:
    """Raise :class:`EndpointUnreachableError` unless something answers at ``endpoint``, and
    :class:`VoltRLError` when its ``/models`` lists models but not ``model``. An endpoint
    without a usable model list (no ``/models``, an answer that is not one) passes."""
    import aiohttp

    async def get_models() -> tuple[int, bytes]:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(
                endpoint.rstrip("/") + "/models", headers={"Authorization": f"Bearer {api_key}"}
            ) as response,
        ):
            return response.status, await response.read()

    def served_models(body: bytes) -> list[str]:
        """The model ids of an OpenAI ``/models`` answer; empty when it is not one."""
        import json

        try:
            data = json.loads(body).get("data")
        except (ValueError, AttributeError):
            return []
        if not isinstance(data, list):
            return []
        return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

    try:
        status, body = asyncio.run(get_models())
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise EndpointUnreachableError(
            f"no OpenAI-compatible endpoint answers at {endpoint} ({type(exc).__name__}: {exc})"
        ) from None
    served = served_models(body) if status == 200 else []
    if model is not None and served and model not in served:
        shown = ", ".join(served[:10]) + (
            f" and {len(served) - 10} more" if len(served) > 10 else ""
        )
        raise VoltRLError(
            f"model {model!r} is not served at {endpoint}; it serves {shown}"
            " (pass one of them to --model)"
        )


def check_llm(llm: LLM, what: str) -> None:
    """:func:`check_endpoint` for an LLM resource before a run (its key from ``api_key_env``
    when it has one); each error starts with ``what``, e.g. "the customer's endpoint"."""
    key = llm.api_key
    if llm.api_key_env:
        key = os.environ.get(llm.api_key_env, "")
        if not key:
            raise VoltRLError(f"{what}: ${llm.api_key_env} (its API key) is not set")
    try:
        check_endpoint(llm.endpoint, key or "EMPTY", llm.model)
    except VoltRLError as e:
        raise VoltRLError(f"{what}: {e}") from None
