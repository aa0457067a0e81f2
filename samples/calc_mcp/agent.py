"""An Agent Framework agent that solves arithmetic word problems with an MCP calculator.

The agent is plain Microsoft Agent Framework: an ``Agent`` on a chat-completions client, with
the calculator MCP server (``calculator_server.py``) as its tool: started over stdio for each
rollout (:data:`calc_agent`), or one server over streamable HTTP shared by every rollout of a
run (:func:`shared_calculator` and :func:`calc_agent_at`). VoltRL adds two lines:
``chat_client(llm, ...)`` points the agent at the rollout's LLM, and ``instrument()`` records
the framework's spans (agent run, model calls, tool calls) in the rollout.
Reward 1 when the last number of the final answer equals the expected answer.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from http.cookiejar import CookieJar, DefaultCookiePolicy
from pathlib import Path
from typing import Any

import httpx2
from agent_framework import Agent, MCPStdioTool, MCPStreamableHTTPTool

import voltrl as vl
from voltrl.adapters.agent_framework import chat_client, instrument
from voltrl.adapters.openai_client import ssl_context

SERVER = Path(__file__).resolve().with_name("calculator_server.py")
INSTRUCTIONS = (
    "Solve the math word problem. Use the calculate tool for every arithmetic step. "
    "Finish with a line 'Answer: <number>'."
)
#: Model round trips per problem (the tool loop stops after this many).
MAX_ROUND_TRIPS = 4


def calculator(
    url: str | None = None, http_client: httpx2.AsyncClient | None = None
) -> MCPStdioTool | MCPStreamableHTTPTool:
    """The calculator MCP server as an Agent Framework tool: a subprocess over stdio of its
    own, or the server at ``url`` (streamable HTTP), through ``http_client`` when given (the
    caller closes it)."""
    if url is None:
        return MCPStdioTool(
            name="calculator",
            command=sys.executable,
            args=[str(SERVER)],
            description="An exact calculator.",
            load_prompts=False,
        )
    return MCPStreamableHTTPTool(
        name="calculator",
        url=url,
        description="An exact calculator.",
        load_prompts=False,
        http_client=http_client,
    )


@contextlib.contextmanager
def shared_calculator(log: Path | None = None, timeout_s: float = 30.0) -> Iterator[str]:
    """One calculator server over streamable HTTP on loopback for the ``with`` block; yields
    its URL (``http://127.0.0.1:PORT/mcp``). Starting it once spares every rollout the second
    of CPU its own stdio server costs. The server picks a free port and prints its URL; the
    rest of its output goes to ``log`` (default: this process's stderr). Raises
    ``RuntimeError`` when it does not start; warns when it died before the block ended."""
    where = f" (its output: {log})" if log is not None else ""
    with contextlib.ExitStack() as stack:
        output = stack.enter_context(log.open("ab")) if log is not None else None
        process = stack.enter_context(
            subprocess.Popen(
                [sys.executable, str(SERVER), "--port", "0"],
                stdout=subprocess.PIPE,
                stderr=output,
                text=True,
            )
        )
        stack.callback(_stop, process)  # before Popen's own exit, which waits for it
        url = _server_url(process, timeout_s, where)
        interrupted = False
        try:
            yield url
        except KeyboardInterrupt:  # Ctrl-C reached the server too: no news
            interrupted = True
            raise
        finally:
            died = process.poll()
            if died is not None and not interrupted:
                print(
                    f"warning: the calculator server had exited with code {died} before the "
                    f"end of the run; calls after that failed{where}",
                    file=sys.stderr,
                )


def _server_url(process: subprocess.Popen[str], timeout_s: float, where: str) -> str:
    """The URL the server prints on stdout, within ``timeout_s``."""
    stdout = process.stdout
    assert stdout is not None
    lines: list[str] = []

    def read() -> None:
        with contextlib.suppress(OSError, ValueError):  # closed when the server is stopped
            for line in stdout:
                lines.append(line)
                if line.startswith("http://"):
                    return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if lines and lines[-1].startswith("http://"):
        return lines[-1].strip()
    if reader.is_alive():
        raise RuntimeError(f"the calculator server did not start within {timeout_s} s{where}")
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)
    raise RuntimeError(
        f"the calculator server exited with code {process.returncode} before it served{where}"
    )


def _stop(process: subprocess.Popen[str]) -> None:
    """Terminate ``process``; kill it if it has not ended 10 s later."""
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def last_number(text: str | None) -> float | None:
    """The last number in ``text`` (``1,250`` and ``3.5`` included), or None."""
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text or "")
    return float(found[-1].replace(",", "")) if found else None


def score(text: str | None, answer: float) -> float:
    """1.0 when the last number of ``text`` is ``answer``, else 0.0."""
    value = last_number(text)
    return float(value is not None and abs(value - float(answer)) < 1e-6)


@contextlib.asynccontextmanager
async def mcp_http_client(url: str | None) -> AsyncIterator[httpx2.AsyncClient | None]:
    """The HTTP client of one MCP connection to ``url`` (None over stdio), closed at the end:
    the one the tool would build for itself (Agent Framework's MCP timeouts, 30 s and 300 s
    to read; redirects followed; no cookies kept), but on the process's one TLS context
    (``voltrl.adapters.openai_client.ssl_context``) rather than a new one per connection,
    whose build reads the CA certificates: about 60 ms of CPU, as much as the rest of a
    rollout's client side."""
    if url is None:
        yield None
        return
    async with httpx2.AsyncClient(
        verify=ssl_context(),
        follow_redirects=True,
        timeout=httpx2.Timeout(30.0, read=300.0),
        cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
    ) as client:
        yield client


async def solve(task: dict[str, Any], llm: vl.LLM, mcp_url: str | None = None) -> float:
    """Solve ``task["question"]`` with the calculator (its own over stdio, or the server at
    ``mcp_url``); the reward is whether the answer is ``task["answer"]``."""
    instrument()
    client = chat_client(
        llm,
        agent_name="solver",
        function_invocation_configuration={
            "max_iterations": MAX_ROUND_TRIPS,
            "include_detailed_errors": True,
        },
    )
    async with mcp_http_client(mcp_url) as http, client.client:
        tools = calculator(mcp_url, http)
        agent = Agent(client=client, name="solver", instructions=INSTRUCTIONS, tools=tools)
        async with agent:
            response = await agent.run(task["question"])
    return score(response.text, task["answer"])


def calc_agent_at(mcp_url: str | None) -> vl.LitAgent:
    """The agent, its calculator the server at ``mcp_url`` (None: its own over stdio)."""

    @vl.rollout
    async def calc_agent(task: dict[str, Any], llm: vl.LLM) -> float:
        """Solve ``task["question"]``; the reward is whether the answer is ``task["answer"]``."""
        return await solve(task, llm, mcp_url)

    return calc_agent


calc_agent = calc_agent_at(None)
"""The agent, each rollout starting its own calculator server over stdio."""
