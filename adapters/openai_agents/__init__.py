"""VoltRL adapter for the OpenAI Agents SDK. From the clone's root:
``pip install -e ".[openai-agents]" -c constraints/frameworks.txt``.

    from agents import Agent, Runner
    from voltrl.adapters import openai_agents as vla

    @vl.rollout
    async def agent(task, llm):
        bot = Agent(name="solver", instructions="...", model=vla.model(llm), tools=[...])
        result = await Runner.run(bot, task["question"])
        return score(result.final_output, task)

:func:`model` is the SDK's chat-completions model on a client that tags every call with the
current rollout and agent. The first model made in a process also calls
:func:`install_tracing`, which puts :class:`VoltRLTracingProcessor` in place of the SDK's
default exporter: the SDK's spans go into the rollout, and nothing goes to OpenAI.
"""

from voltrl.adapters.openai_agents.model import (
    VoltRLChatCompletionsModel,
    model,
    model_settings,
    running_agent_name,
)
from voltrl.adapters.openai_agents.tracing import (
    VoltRLTracingProcessor,
    ensure_tracing,
    install_tracing,
)

__all__ = [
    "VoltRLChatCompletionsModel",
    "VoltRLTracingProcessor",
    "ensure_tracing",
    "install_tracing",
    "model",
    "model_settings",
    "running_agent_name",
]
