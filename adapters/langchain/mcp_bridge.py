"""MCP server tools as LangChain tools, with the ``mcp`` 2.x client.

``langchain-mcp-adapters`` is written against ``mcp`` 1.x and does not work with ``mcp`` 2, which
VoltRL pins (``agent-framework-core`` needs it). This bridge lists a server's tools with
``mcp.Client`` and wraps each in a LangChain ``StructuredTool`` whose arguments are the tool's
JSON schema::

    from mcp import StdioServerParameters

    server = StdioServerParameters(command=sys.executable, args=["calc_server.py"])
    async with mcp_tools(server) as tools:
        graph = create_agent(chat_model(llm), tools=tools)
        await graph.ainvoke(...)

The tools are async (``ainvoke``) and live as long as the ``async with`` block keeps the server
session open. A result the server marks ``isError`` reaches the model as the tool's error text
(LangChain's ``ToolException`` with ``handle_tool_error``), and the tool's span ends ``error``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Collection
from typing import Any

from langchain_core.tools import BaseTool, StructuredTool, ToolException
from mcp import Client
from mcp.types import CallToolResult, TextContent, Tool


def result_text(result: CallToolResult) -> str:
    """The text of a tool result: its text blocks joined by newlines, other blocks as JSON,
    the structured result as JSON when there are no blocks."""
    parts = [
        block.text if isinstance(block, TextContent) else block.model_dump_json(by_alias=True)
        for block in result.content
    ]
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


def mcp_tool(client: Client, spec: Tool) -> StructuredTool:
    """One MCP tool of an open ``client`` as a LangChain tool."""

    async def call(**arguments: Any) -> str:
        result = await client.call_tool(spec.name, arguments)
        text = result_text(result)
        if result.is_error:
            raise ToolException(text)
        return text

    return StructuredTool(
        name=spec.name,
        description=spec.description or spec.name,
        args_schema=spec.input_schema,
        coroutine=call,
        handle_tool_error=True,
    )


async def list_tools(client: Client, names: Collection[str] | None = None) -> list[BaseTool]:
    """All tools of an open ``client`` (following pagination), or those in ``names``."""
    specs: list[Tool] = []
    cursor: str | None = None
    while True:
        page = await client.list_tools(cursor=cursor)
        specs.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            break
    if names is not None:
        missing = set(names) - {s.name for s in specs}
        if missing:
            raise ValueError(f"the MCP server has no tool {sorted(missing)}")
        specs = [s for s in specs if s.name in names]
    return [mcp_tool(client, s) for s in specs]


@contextlib.asynccontextmanager
async def mcp_tools(
    server: Any,
    *,
    names: Collection[str] | None = None,
    read_timeout_seconds: float | None = None,
) -> AsyncIterator[list[BaseTool]]:
    """Open an MCP session and yield the server's tools as LangChain tools.

    Args:
        server: what ``mcp.Client`` connects to: ``mcp.StdioServerParameters`` (a subprocess
            over stdio), a Streamable HTTP URL, or an in-process ``MCPServer``.
        names: only these tools (a missing one is a ``ValueError``).
        read_timeout_seconds: timeout of each MCP request.
    """
    async with Client(server, read_timeout_seconds=read_timeout_seconds) as client:
        yield await list_tools(client, names)
