"""The smallest VoltRL agent: a bare OpenAI client answering arithmetic questions.

    voltrl dev samples/quickstart/agent.py:agent --data samples/quickstart/tasks.jsonl \
        --llm-endpoint http://127.0.0.1:8000/v1 --model my-model

The agent's code is ordinary OpenAI-client code; VoltRL hands it the endpoint to use.
"""

from __future__ import annotations

import re

import voltrl as vl


@vl.rollout
async def agent(task: dict, llm: vl.LLM) -> float:
    """Ask the model the question; reward 1 if the last number in its answer is right."""
    client = llm.openai_client()  # the rollout's endpoint and key, on shared connections
    response = await client.chat.completions.create(
        model=llm.model,
        messages=[
            {"role": "system", "content": "Answer with the number only."},
            {"role": "user", "content": task["question"]},
        ],
        **llm.sampling_parameters,
    )
    numbers = re.findall(r"-?\d+", response.choices[0].message.content or "")
    return float(bool(numbers) and int(numbers[-1]) == int(task["answer"]))
