"""VoltRL for AutoGen: keep your AutoGen agent, train it. From the clone's root:
``pip install -e ".[autogen]" -c constraints/frameworks.txt``.

- :func:`model_client` builds AutoGen's ``OpenAIChatCompletionClient`` (chat-completions)
  from a :class:`voltrl.LLM`, with an agent name for multi-agent systems;
- :func:`instrument` (called by :func:`model_client`) records AutoGen's OpenTelemetry spans
  (agent steps, tool calls with their results and success or failure) into the rollout;
- :func:`mcp_tools` gives an MCP server's tools as AutoGen tools with ``mcp`` 2.x, where
  AutoGen's own ``McpWorkbench`` does not work.

::

    from autogen_agentchat.agents import AssistantAgent
    from voltrl.adapters.autogen import model_client

    @vl.rollout
    async def agent(task, llm):
        bot = AssistantAgent("solver", model_client=model_client(llm), tools=[calculator])
        result = await bot.run(task=task["question"])
        return score(result.messages[-1].content, task["answer"])
"""

from voltrl.adapters.autogen.mcp_bridge import McpTool, McpToolError, mcp_tools
from voltrl.adapters.autogen.models import DEFAULT_MODEL_INFO, model_client
from voltrl.adapters.autogen.tracing import instrument, record_tool_results, tracer_provider

__all__ = [
    "DEFAULT_MODEL_INFO",
    "McpTool",
    "McpToolError",
    "instrument",
    "mcp_tools",
    "model_client",
    "record_tool_results",
    "tracer_provider",
]
