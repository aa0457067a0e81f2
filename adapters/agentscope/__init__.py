"""AgentScope 2.x adapter (``pip install -e ".[agentscope,local]" -c constraints/agentscope.txt``).

- :func:`chat_model`: AgentScope's ``OpenAIChatModel`` for a :class:`~voltrl.LLM`,
  rollout-safe and with the LLM's sampling parameters;
- :class:`AgentNames`: a middleware recording each call under its agent's name (for a model
  shared by several agents);
- :func:`instrument`: AgentScope's OpenTelemetry spans (``agentscope.middleware.
  TracingMiddleware`` on your agents: replies, model calls, tool calls with their results)
  into the rollout, exported nowhere else.

AgentScope 2.0.5-2.0.10 need ``mcp`` < 2, the other frameworks ``mcp`` 2: AgentScope gets an
environment of its own. See ``docs/adapters/agentscope.md``.
"""

from voltrl.adapters.agentscope.model import AgentNames, chat_model, model_parameters
from voltrl.adapters.agentscope.tracing import instrument

__all__ = ["AgentNames", "chat_model", "instrument", "model_parameters"]
