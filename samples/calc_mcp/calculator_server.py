"""An MCP calculator server on stdio, written with the ``mcp`` 2.x SDK.

One tool, ``calculate(expression)``: ``+ - * / // % **`` and parentheses over integers and
decimals, evaluated safely (no names, no calls). A bad expression raises ``ToolError``: the
client gets an error result with the reason ("division by zero"). Run by the agent as a
subprocess over stdio, or once for every rollout of a run over streamable HTTP::

    python samples/calc_mcp/calculator_server.py              # MCP on stdin/stdout
    python samples/calc_mcp/calculator_server.py --port 8931  # MCP at http://127.0.0.1:8931/mcp
    python samples/calc_mcp/calculator_server.py --port 0     # a free port; prints the URL
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_EXPONENT = 64

server = MCPServer(
    "calculator", instructions="Evaluate arithmetic expressions exactly.", log_level="WARNING"
)


def evaluate(expression: str) -> float:
    """The value of an arithmetic ``expression``; ``ValueError`` when it is not one."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    try:
        return ev(ast.parse(expression.replace(",", ""), mode="eval").body)
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}") from exc
    except ZeroDivisionError as exc:
        raise ValueError("division by zero") from exc
    except OverflowError as exc:
        raise ValueError("the result is too large") from exc


def format_number(value: float) -> str:
    """``12`` for whole numbers, else up to 10 significant decimals."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.10g}"


@server.tool(structured_output=False)
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression such as "(12 + 7) * 3" and return the result."""
    try:
        return format_number(evaluate(expression))
    except ValueError as exc:
        raise ToolError(str(exc)) from exc


def serve_http(port: int = 0) -> None:
    """Serve over streamable HTTP at ``http://127.0.0.1:PORT/mcp`` (``port=0``: a free port),
    after writing that URL as a line on stdout: whoever started the server reads it there,
    with no race for the port. Everything printed after it goes to stderr."""
    import os
    import socket

    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    print(f"http://127.0.0.1:{sock.getsockname()[1]}/mcp", flush=True)
    os.dup2(2, 1)  # nobody reads stdout after the URL: a full pipe would block the server
    app = server.streamable_http_app(stateless_http=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


def main(argv: list[str] | None = None) -> None:
    """Serve over stdio, or over streamable HTTP on loopback with ``--port``."""
    import argparse

    parser = argparse.ArgumentParser(description="The calculator MCP server.")
    parser.add_argument(
        "--port",
        type=int,
        help="serve at http://127.0.0.1:PORT/mcp instead (0: a free port); the URL is printed",
    )
    args = parser.parse_args(argv)
    if args.port is None:
        server.run("stdio")
    else:
        serve_http(args.port)


if __name__ == "__main__":
    main()
