"""A review classifier whose only lever is its prompt: it renders the ``prompt_template``
resource with the review, asks the model once (greedy, a few tokens), and is right when the
first word of the reply is the review's label. APO (``run.py``) improves the template."""

from __future__ import annotations

import re
from typing import Any

from openai import AsyncOpenAI

import voltrl as vl

START = "{text}"
"""A deliberately poor starting template: the review alone, with no question and no format,
so the model comments on the review instead of labelling it."""


def label_of(reply: str) -> str | None:
    """The label a reply gives: its first word, lower-cased, when that is a label."""
    words = re.findall(r"[a-z]+", reply.lower())
    return words[0] if words and words[0] in ("positive", "negative") else None


@vl.rollout
async def classify(task: dict[str, Any], resources: vl.Resources) -> float:
    """1.0 when the reply's first word is the review's label, else 0.0."""
    llm, template = resources["main_llm"], resources["prompt_template"]
    assert isinstance(llm, vl.LLM) and isinstance(template, vl.PromptTemplate)
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key)
    reply = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": template.format(text=task["text"])}],
        max_tokens=8,
        temperature=0.0,
    )
    return float(label_of(reply.choices[0].message.content or "") == task["label"])
