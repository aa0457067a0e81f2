"""Agents whose recorded token ids drift, or do not, for the token-drift audit's tests.

Like ``rl_agents``, this module imports only voltrl and openai (a runner process loads it)."""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

import voltrl as vl

ROWS = [{"letter": c} for c in "ab"]
"""Two tasks: say this letter."""


async def _two_turns(task: dict, llm: vl.LLM, sent_back: Any, **sampling: Any) -> float:
    """Two chat calls of one conversation: the first answer goes back as ``sent_back(text)``."""
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    params = {**llm.sampling_parameters, **sampling}
    messages = [{"role": "user", "content": f"Say {task['letter']}."}]
    first = await client.chat.completions.create(model=llm.model, messages=messages, **params)
    text = first.choices[0].message.content or ""
    messages += [
        {"role": "assistant", "content": sent_back(text)},
        {"role": "user", "content": "Again."},
    ]
    second = await client.chat.completions.create(model=llm.model, messages=messages, **params)
    return float(task["letter"] in (second.choices[0].message.content or ""))


@vl.rollout
async def faithful_agent(task: dict, llm: vl.LLM) -> float:
    """Sends the first answer back as it came (greedy: the untrained model's replies are then
    the same every run, and text that re-tokenizes to the sampled ids)."""
    return await _two_turns(task, llm, lambda text: text, temperature=0)


@vl.rollout
async def stripping_agent(task: dict, llm: vl.LLM) -> float:
    """Sends the first answer back changed, as frameworks do: stripped, and ``!`` added
    (greedy, as :func:`faithful_agent`: the change is the only drift)."""
    return await _two_turns(task, llm, lambda text: text.strip() + "!", temperature=0)


@vl.rollout
async def altered_transitions_agent(task: dict, llm: vl.LLM) -> list[vl.Transition]:
    """One call, returned as an explicit transition whose last generated token is not the
    one sampled: trained-token drift."""
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    answer = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": f"Say {task['letter']}."}],
        extra_body={"return_token_ids": True},
        **llm.sampling_parameters,
    )
    extra = answer.model_extra or {}
    choice = answer.choices[0].model_extra or {}
    prompt = choice.get("prompt_token_ids") or extra["prompt_token_ids"]
    response = list(choice["token_ids"])
    response[-1] = (response[-1] + 1) % 400  # not what was sampled
    return [vl.Transition(prompt_token_ids=prompt, response_token_ids=response, reward=1.0)]
