"""What LocalRL reports as it trains: each step's console line and warnings, the adapters'
summary, the reward curve.

Plain functions of what a step did; :class:`~voltrl.algorithms.local.algorithm.LocalRL`
decides when to print them (a warning once per run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from voltrl.observability.metrics import RewardStats
from voltrl.trajectory import TrainingBatch


def step_line(
    step: int,
    steps: int,
    stats: RewardStats,
    trained: Mapping[str | None, Mapping[str, Any]],
    rollout_s: float,
    update_s: float,
    staleness: Mapping[str, float] | None = None,
) -> str:
    """The console line of training step ``step`` (0-based) of ``steps`` (with adapters, the
    update of each); ``staleness``: the step's ``staleness/*`` and ``dropped/stale`` metrics,
    shown when steps are queued ahead (``rollouts`` is then the wait for the step's last
    rollout, which may have finished during the previous update)."""
    head = f"step {step + 1}/{steps}  reward {stats.reward_mean or 0:.3f}"
    times = f"  rollouts {rollout_s:.1f}s  update {update_s:.1f}s"
    if staleness is not None:
        times += f"  staleness max {staleness['staleness/max']:.0f} mean "
        times += f"{staleness['staleness/mean']:.2f}"
        if staleness["dropped/stale"]:
            times += f" ({staleness['dropped/stale']:.0f} stale rollouts dropped)"
    if not stats.succeeded:
        return f"{head}  every rollout failed: not trained{times}"
    if not trained:
        return f"{head}  no trainable rows: not trained{times}"
    parts = []
    for key, m in trained.items():
        done = (
            f"trained {m['adv_tokens']:.0f} tok ({m.get('tokens_per_s', 0):.0f}/s)"
            if m["adv_tokens"]
            else "trained 0 tokens with non-zero advantage"
        )
        name = "" if key is None else f"[{key}] reward {m['reward_mean']:.3f}  "
        parts.append(f"{name}loss {m['loss']:.4f}  entropy {m['entropy']:.3f}  {done}")
    return f"{head}  {'  '.join(parts)}{times}"


def same_reward_warning(step: int) -> str:
    """Step ``step`` (0-based) trained no token: every GRPO group's rewards were equal."""
    return (
        f"warning: in step {step + 1} every group had the same reward, so no token has"
        " a non-zero advantage and the rewards trained nothing. GRPO learns from reward"
        " differences within a task's group: make rewards vary, or raise group_size or"
        " the sampling temperature (this warning is shown once)"
    )


CUT_OFF_COUNTS = {"calls": 0, "stopped/length": 0}
"""The batch counts every step logs, 0 when the batch has none (a curve with no gaps)."""

CUT_OFF_WARNING_SHARE = 0.1
"""The share of a step's selected replies cut off (``stopped/length``) that gets a warning."""


def cut_off_warning(stats: Mapping[str, int], step: int, max_tokens: int | None) -> str | None:
    """The warning for step ``step`` (0-based) when at least :data:`CUT_OFF_WARNING_SHARE` of
    the replies its trajectories selected (the batch's ``stats``: ``calls``) stopped at their
    token cap (``stopped/length``): ``max_tokens``, LocalRL's sampling cap, or with none the
    end of the model's context. None otherwise."""
    cut, calls = stats.get("stopped/length", 0), stats.get("calls", 0)
    if not calls or cut < CUT_OFF_WARNING_SHARE * calls:
        return None
    head = f"warning: in step {step + 1}, {cut} of {calls} sampled replies were cut off"
    if max_tokens is None:
        return (
            f"{head} at the end of the model's context (no sampling max_tokens): the prompts "
            "leave the replies too little room. Shorten them (a smaller history), or set "
            'LocalRL(sampling={"max_tokens": ...}) so that a reply that rambles stops sooner '
            "(this warning is shown once)"
        )
    return (
        f"{head} at their max_tokens (LocalRL's sampling: {max_tokens}, unless the agent's "
        "request set its own); a tool call cut off is broken. If they should have finished, "
        'raise LocalRL(sampling={"max_tokens": ...}); if they ramble, the cap is doing its '
        "job (this warning is shown once)"
    )


def untrained_warning(
    batch: TrainingBatch, untrained: Sequence[int], step: int, patterns: Mapping[str, str]
) -> str:
    """Rows ``untrained`` of step ``step`` (0-based) matched none of the adapters'
    ``patterns`` (a typo in a pattern, say): which agents they came from."""
    agents = sorted({str(batch.agent_names[i]) for i in untrained})
    adapters = ", ".join(f"{k}={v!r}" for k, v in patterns.items())
    return (
        f"warning: in step {step + 1}, {len(untrained)} of {len(batch)} rows matched no LoRA "
        f"adapter (agents: {', '.join(agents)}; adapters: {adapters}): the base model served "
        'them and they train nothing. Add an adapter for them (".*" last catches the rest) '
        "if they should train (this warning is shown once)"
    )


def adapters_summary(
    names: Sequence[str], history: Sequence[Mapping[str, Any]], updates: Mapping[str, int]
) -> str:
    """What each adapter got: its ``updates`` in all, and in this session's ``history`` (since
    the start or the resume) the tokens it trained with a non-zero advantage and its rows'
    reward at the first and last update; where it was saved."""
    lines = ["LoRA adapters (tokens and reward: this session):"]
    for name in names:
        rewards = [
            h[f"update/{name}/reward_mean"] for h in history if f"update/{name}/reward_mean" in h
        ]
        tokens = sum(h.get(f"update/{name}/adv_tokens", 0) for h in history)
        trend = f"{rewards[0]:.3f} -> {rewards[-1]:.3f}" if rewards else "-"
        count = updates[name]
        lines.append(
            f"  {name}: {count} update{'s' * (count != 1)}, {tokens:.0f} tokens trained "
            f"with an advantage, its rows' reward {trend}; saved in final/adapters/{name}"
        )
    return "\n".join(lines)


def draw_reward_curve(history: Sequence[Mapping[str, Any]], run_dir: Path, name: str) -> None:
    """``reward_curve.png`` in the run directory from the run's metrics ``history``; a failure
    to draw is only reported (it must not hide why the run ended)."""
    from voltrl.observability.plots import reward_curve

    try:
        reward_curve(history, run_dir / "reward_curve.png", name)
    except Exception as exc:
        print(f"warning: reward_curve.png not drawn: {type(exc).__name__}: {exc}", flush=True)


def stopped_line(stopped: str, saved: Path | None, steps_done: int, torn: bool, where: Path) -> str:
    """What a run that stopped early (``stopped``: "interrupted" or "failed (Error)") says
    about its weights: the checkpoint ``saved``, or why there is none (``torn``: an update
    failed after it had begun to change them; ``where``: the run's checkpoints)."""
    if saved is not None:
        return f"{stopped}: checkpoint of step {steps_done} in {saved}"
    if torn:
        return (
            f"{stopped}: no checkpoint of these weights: the update of step {steps_done + 1} "
            f"failed after it had begun to change them, so they belong to no step; "
            f"checkpoints.resume continues from the latest checkpoint in {where}, if any"
        )
    return f"{stopped}: no checkpoint: no update was done"
