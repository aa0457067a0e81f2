"""Supervised warm-up: teach a model a format (chat turns, tool calls) before RL.

``tokenize_conversation`` renders a conversation with the tokenizer's chat template and marks
the assistant's tokens; ``supervised_warmup`` trains on them with cross-entropy (next-token
loss on assistant tokens only). A tiny model built from scratch needs this before RL has any
reward to work with; a real instruct model usually does not.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from voltrl.algorithms.local.threads import use_threads

Conversation = dict[str, Any]
"""``{"messages": [...], "tools": [...] (optional)}`` in OpenAI chat format."""


def tokenize_conversation(
    tokenizer: Any, conversation: Conversation
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a mask that is 1 on assistant tokens.

    Each assistant turn is the difference between the rendering up to it (with the generation
    prompt) and the rendering including it, up to and including its end-of-turn token: exactly
    what the model would have generated.
    """
    messages, tools = conversation["messages"], conversation.get("tools")

    def ids(msgs: list[dict[str, Any]], gen: bool) -> list[int]:
        out = tokenizer.apply_chat_template(
            msgs, tools=tools, tokenize=True, add_generation_prompt=gen, return_dict=False
        )
        return list(out["input_ids"] if isinstance(out, dict) else out)

    full = ids(messages, False)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if not isinstance(end_of_turn, int) or end_of_turn == tokenizer.unk_token_id:
        end_of_turn = tokenizer.eos_token_id
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(ids(messages[:i], True))
        end = len(ids(messages[: i + 1], False))
        if full[:end] != ids(messages[: i + 1], False):
            raise ValueError("the chat template does not render conversations incrementally")
        for k in range(start, min(end, len(full))):
            mask[k] = 1
            if full[k] == end_of_turn:  # what the template adds after it is not generated
                break
    return full, mask


def supervised_warmup(
    model: torch.nn.Module,
    tokenizer: Any,
    conversations: Sequence[Conversation],
    *,
    steps: int,
    batch_size: int = 16,
    lr: float = 3e-3,
    warmup_steps: int = 20,
    seed: int = 0,
    threads: int | None = None,
    log: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` on the assistant turns of ``conversations``; returns the loss per step.

    AdamW with linear warm-up and cosine decay; batches are sampled with replacement. torch
    runs ``threads`` intra-op threads (default: :func:`~.threads.decide_threads`'s, half the
    usable CPUs), set for the calling thread.
    """
    use_threads(threads)
    rng = random.Random(seed)
    data = [tokenize_conversation(tokenizer, c) for c in conversations]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model.train()
    losses: list[float] = []
    for step in range(steps):
        batch = [data[rng.randrange(len(data))] for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((batch_size, width), pad, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        attention = torch.zeros((batch_size, width), dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            labels[row, : len(ids)] = torch.tensor(
                [t if m else -100 for t, m in zip(ids, mask, strict=True)]
            )
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if log is not None:
            log(step, losses[-1])
    model.eval()
    return losses
