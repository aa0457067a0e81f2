"""The supervised training loop: AdamW steps on a batch's masked response tokens.

:func:`fit_rows` is the one loop of SFT (:class:`~voltrl.algorithms.local.sft.SFT`, on recorded
rollouts) and of :func:`supervised_warmup` (on written conversations: the calculator demo
teaches a tiny model the format this way). Its rows are fed in micro-batches by
:class:`~voltrl.algorithms.local.token_rows.TokenRows`, as the policy update feeds its rows.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from voltrl.algorithms.local.conversations import Conversation, conversation_batch
from voltrl.models.threads import use_threads

if TYPE_CHECKING:
    import torch

    from voltrl.trajectory import TrainingBatch


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
    """Train ``model`` on the assistant turns of ``conversations``; returns the loss per step
    (``log(step, loss)`` is called after each).

    The conversations become rows (:func:`conversation_batch`) and train in SFT's loop,
    :func:`fit_rows`: AdamW with linear warm-up and cosine decay, ``batch_size`` rows per
    step in a fresh shuffled order each epoch (fewer conversations than ``batch_size``
    repeat within a step). torch runs ``threads`` intra-op threads (default:
    :func:`~voltrl.models.threads.decide_threads`'s, the usable CPUs other processes leave
    free), set for the calling thread.
    """
    each = None if log is None else lambda step, values: log(step, values["loss"])
    return fit_rows(
        model,
        conversation_batch(tokenizer, conversations),
        steps=steps,
        batch_size=batch_size,
        micro_batch_size=batch_size,
        lr=lr,
        warmup_steps=warmup_steps,
        seed=seed,
        threads=threads,
        log=each,
    )


def cosine_schedule(steps: int, warmup_steps: int) -> Callable[[int], float]:
    """The learning-rate factor of a step: linear warm-up, then cosine decay to 0.1."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def fit_rows(
    model: torch.nn.Module,
    batch: TrainingBatch,
    *,
    steps: int,
    batch_size: int,
    micro_batch_size: int,
    lr: float,
    warmup_steps: int,
    seed: int = 0,
    threads: int | None = None,
    log: Callable[[int, dict[str, float]], None] | None = None,
    stop: threading.Event | None = None,
) -> list[float]:
    """Train ``model`` on ``batch``'s masked response tokens; the loss per step.

    ``steps`` AdamW steps (weight decay 0.01, gradients clipped at 1, learning rate ``lr``
    with :func:`cosine_schedule`) of ``batch_size`` rows, the rows with a trained token in a
    fresh shuffled order each epoch. A step's loss is the mean NLL of its trained tokens::

        loss = - sum_t m_t * log pi(y_t | y_<t) / sum_t m_t

    however its rows are split into micro-batches of at most ``micro_batch_size``
    (:meth:`~voltrl.algorithms.local.token_rows.TokenRows.micro_batches`: rows sharing a prompt
    prefix together, that prefix fed once). ``log(step, {"loss", "tokens", "lr"})`` after each
    step; the loop ends early, between steps, once ``stop`` is set. torch runs ``threads``
    intra-op threads in the calling thread. Leaves no gradient and the model in eval mode.
    """
    import torch

    from voltrl.algorithms.local.master_weights import MasterWeights
    from voltrl.algorithms.local.token_rows import TokenRows

    use_threads(threads)
    data = TokenRows.of(batch, next(model.parameters()).device)
    mask = data.response_mask
    row_tokens = mask.sum(1).tolist()
    rows = data.trained
    if not rows:
        raise ValueError("nothing to train on: no row has a trained token")
    rng = random.Random(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = MasterWeights(params)  # float32 copies of half-precision weights, if any
    optimizer = torch.optim.AdamW(masters.optimized, lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_schedule(steps, warmup_steps))
    order: list[int] = []
    model.train()
    losses: list[float] = []
    for step in range(steps):
        if stop is not None and stop.is_set():  # the run was cancelled: stop between steps
            break
        chosen = []
        while len(chosen) < batch_size:
            if not order:
                order = rng.sample(rows, len(rows))
            chosen.append(order.pop())
        tokens = float(sum(row_tokens[i] for i in chosen))
        total = 0.0
        optimizer.zero_grad(set_to_none=True)
        for idx, first, width in data.micro_batches(model, chosen, max_rows=micro_batch_size):
            logp, _, _ = data.logprobs(model, idx, first, width, with_entropy=False)
            loss = -(logp * mask[idx, :width]).sum() / tokens
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(masters.optimized, 1.0)
        optimizer.step()
        masters.masters_to_params()
        scheduler.step()
        losses.append(total)
        if log is not None:
            log(step, {"loss": total, "tokens": tokens, "lr": scheduler.get_last_lr()[0]})
    masters.close()  # LocalRL's optimizer trains these weights next
    model.zero_grad(set_to_none=True)  # nothing of SFT's reaches a later optimizer
    model.eval()
    return losses
