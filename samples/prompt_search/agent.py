"""A review classifier whose only lever is its prompt: it renders the ``prompt_template``
resource with the review, asks the model once (greedy, a few tokens, unless its LLM's sampling
says otherwise), and is right when the label its reply names first is the review's. APO
(``run.py``) improves the template; ``benchmarks/prompt_and_weights.py`` adds LocalRL."""

from __future__ import annotations

import re
from typing import Any

import voltrl as vl

START = "{text}"
"""A deliberately poor starting template: the review alone, with no question and no format,
so the model comments on the review instead of labelling it."""


SAMPLING = {"temperature": 0.0, "max_tokens": 12}
"""How the classifier asks: greedy, a few tokens, unless its LLM says otherwise (LocalRL
samples its training rollouts at temperature 1 and validates greedily)."""


def label_of(reply: str) -> str | None:
    """The label a reply gives: the first of the words ``positive`` and ``negative`` in it
    (``This review is positive.``), or None when it names neither."""
    words = [w for w in re.findall(r"[a-z]+", reply.lower()) if w in ("positive", "negative")]
    return words[0] if words else None


@vl.rollout
async def classify(task: dict[str, Any], resources: vl.Resources) -> float:
    """1.0 when the label the reply names first is the review's, else 0.0."""
    llm, template = resources["main_llm"], resources["prompt_template"]
    assert isinstance(llm, vl.LLM) and isinstance(template, vl.PromptTemplate)
    client = llm.openai_client()
    reply = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": template.format(text=task["text"])}],
        **{**SAMPLING, **llm.sampling_parameters},
    )
    return float(label_of(reply.choices[0].message.content or "") == task["label"])
