"""LangChain / LangGraph adapter: ``pip install -e ".[langchain]" -c constraints/frameworks.txt``.

- :func:`chat_model` builds LangChain's ``ChatOpenAI`` from a :class:`voltrl.LLM` (chat-completions,
  sampling parameters from the LLM, calls recorded against the running rollout and named after
  the agent or LangGraph node making them);
- :class:`VoltRLCallbackHandler` records chains, LangGraph nodes, model calls and tool calls as
  spans of the rollout; attach it with :func:`tracing_config` or :func:`instrument`;
- :func:`mcp_tools` turns an MCP server's tools into LangChain tools with the ``mcp`` 2.x client
  (``langchain-mcp-adapters`` does not work with ``mcp`` 2).

    from voltrl.adapters.langchain import chat_model, tracing_config

    @vl.rollout
    async def agent(task, llm):
        graph = create_agent(chat_model(llm), tools=[...])
        result = await graph.ainvoke({"messages": [...]}, config=tracing_config())
        return reward(result)
"""

from voltrl.adapters.langchain.callbacks import (
    VoltRLCallbackHandler,
    agent_name_from,
    callback_handler,
    instrument,
    tracing_config,
)
from voltrl.adapters.langchain.chat_model import (
    GatewayChatOpenAI,
    chat_model,
    sampling_fields,
)
from voltrl.adapters.langchain.mcp_bridge import mcp_tools

__all__ = [
    "GatewayChatOpenAI",
    "VoltRLCallbackHandler",
    "agent_name_from",
    "callback_handler",
    "chat_model",
    "instrument",
    "mcp_tools",
    "sampling_fields",
    "tracing_config",
]
