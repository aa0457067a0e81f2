"""Microsoft Agent Framework adapter. From the clone's root:
``pip install -e ".[agent-framework]" -c constraints/frameworks.txt``.

- :func:`chat_client`: the framework's chat-completions client (``OpenAIChatCompletionClient``)
  for a :class:`~voltrl.LLM`, rollout-safe and with the LLM's sampling parameters;
- :func:`chat_options`: those sampling parameters as ``default_options``;
- :func:`instrument`: the framework's OpenTelemetry spans (agent runs, model calls, tool and
  MCP calls) into the rollout, exported nowhere else.

MCP tools need nothing from VoltRL: Agent Framework's own ``MCPStdioTool`` /
``MCPStreamableHTTPTool`` work with ``mcp`` 2.x. See ``docs/adapters/agent_framework.md``.
"""

from voltrl.adapters.agent_framework.client import SamplingDefaults, chat_client, chat_options
from voltrl.adapters.agent_framework.tracing import instrument

__all__ = ["SamplingDefaults", "chat_client", "chat_options", "instrument"]
