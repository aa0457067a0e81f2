"""MCP server tools as AutoGen tools, with the ``mcp`` 2.x client.

AutoGen 0.7's own MCP support (``autogen_ext.tools.mcp``, ``McpWorkbench``) is written for
``mcp`` 1.x and cannot even be imported with ``mcp`` 2.x, which VoltRL pins (Microsoft Agent
Framework needs it). This bridge lists a server's tools with ``mcp.Client`` and wraps each
in an AutoGen :class:`~autogen_core.tools.BaseTool`, so an ``AssistantAgent`` calls them like
any other tool, with AutoGen's ``execute_tool`` span around every call::

    from mcp import StdioServerParameters

    server = StdioServerParameters(command=sys.executable, args=["calc_server.py"])
    async with mcp_tools(server) as tools:
        agent = AssistantAgent("calc", model_client=client, tools=tools)
        await agent.run(task="What is 6 * 7?")
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

import mcp_types
from autogen_core import CancellationToken
from autogen_core.tools import BaseTool
from autogen_core.utils import schema_to_pydantic_model
from mcp import Client, StdioServerParameters
from pydantic import BaseModel


class McpToolError(RuntimeError):
    """The MCP server answered a tool call with ``isError``; the message is its content."""


def result_text(result: mcp_types.CallToolResult) -> str:
    """A tool result's content as text: text blocks as they are, other blocks as JSON."""
    parts = [
        block.text
        if isinstance(block, mcp_types.TextContent)
        else json.dumps(block.model_dump(mode="json", exclude_none=True))
        for block in result.content
    ]
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


class McpTool(BaseTool[BaseModel, str]):
    """One tool of a connected MCP server. Its arguments model comes from the tool's input
    schema; a call returns the result's text, or raises :class:`McpToolError` when the
    server reports an error (AutoGen then marks the tool span ``error`` and shows the model
    the message)."""

    def __init__(self, client: Client, tool: mcp_types.Tool) -> None:
        args_type = schema_to_pydantic_model(tool.input_schema, f"{tool.name}_args")
        super().__init__(args_type, str, tool.name, tool.description or "")
        self._client = client

    async def run(self, args: BaseModel, cancellation_token: CancellationToken) -> str:
        """Call the tool on the server."""
        result = await self._client.call_tool(self.name, args.model_dump(exclude_unset=True))
        text = result_text(result)
        if result.is_error:
            raise McpToolError(text or f"tool {self.name} failed")
        return text


async def list_tools(client: Client) -> list[mcp_types.Tool]:
    """Every tool a connected server offers (all pages)."""
    tools: list[mcp_types.Tool] = []
    cursor: str | None = None
    while True:
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            return tools


def _single_leaf(group: BaseExceptionGroup) -> BaseException | None:
    """The one exception inside (possibly nested) exception groups, or None if several."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
    return leaves[0] if len(leaves) == 1 else None


@contextlib.asynccontextmanager
async def mcp_tools(
    server: StdioServerParameters | str,
    *,
    names: Iterable[str] | None = None,
    **client_kwargs: Any,
) -> AsyncIterator[list[McpTool]]:
    """Connect to an MCP server (a stdio command, or a Streamable HTTP URL) and yield its
    tools as AutoGen tools, ``names`` only if given; the connection (and a stdio server's
    process) closes when the block ends. ``client_kwargs`` go to ``mcp.Client``
    (``read_timeout_seconds``, ...). Enter and leave the block in the same task.

    ``mcp.Client`` wraps an exception raised in the block in nested exception groups; when
    there is just one exception inside, it is raised as it is.
    """
    try:
        async with Client(server, **client_kwargs) as client:
            listed = await list_tools(client)
            wanted = set(names) if names is not None else None
            if wanted is not None and (missing := wanted - {t.name for t in listed}):
                raise ValueError(f"the MCP server has no tool {sorted(missing)}")
            yield [McpTool(client, t) for t in listed if wanted is None or t.name in wanted]
    except BaseExceptionGroup as group:
        leaf = _single_leaf(group)
        if leaf is None:
            raise
        raise leaf from None
