"""The plots a run leaves in its directory: LocalRL's ``reward_curve.png``, SFT's
``sft_loss.png``, APO's ``prompt_search.png``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from voltrl.observability.prompt_search import PromptSearch


def reward_curve(history: Sequence[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Plot the training reward per step and the validation reward (``train/reward_mean``,
    ``val/reward_mean`` in metrics records) into ``path``; None when there is nothing to plot
    or matplotlib (the ``[local]`` extra) is missing."""

    def points(key: str) -> list[tuple[int, float]]:
        return [(h["step"], h[key]) for h in history if h.get(key) is not None]

    train, val = points("train/reward_mean"), points("val/reward_mean")
    if (not train and not val) or (plt := _pyplot()) is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="training reward (sampled)", alpha=0.6)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation reward", linewidth=2)
    ax.set(xlabel="policy update", ylabel="mean reward", title=title)
    return _save(plt, fig, ax, path, legend=True)


def loss_curve(losses: Sequence[float], path: Path, title: str) -> Path | None:
    """Plot a loss per optimizer step (SFT's) into ``path``; None when there is nothing to
    plot or matplotlib is missing."""
    if not losses or (plt := _pyplot()) is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, linewidth=1.5)
    ax.set(xlabel="SFT step", ylabel="loss (mean over trained tokens)", title=title)
    return _save(plt, fig, ax, path, legend=False)


def prompt_search_curve(search: PromptSearch, path: Path) -> Path | None:
    """Plot an APO run's validation score of every candidate by round, and the best so far,
    into ``path``; None when nothing was scored or matplotlib is missing."""
    scored = [c for c in search.candidates if c.score is not None]
    if not scored or (plt := _pyplot()) is None:
        return None
    rounds = range(search.rounds_done + 1)
    best, running = [], float("-inf")
    for r in rounds:
        running = max([running] + [c.score or 0.0 for c in scored if c.round == r])
        best.append(running)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([c.round for c in scored], [c.score for c in scored], "o", alpha=0.5, label="candidate")
    ax.plot(list(rounds), best, "-", linewidth=2, label="best so far")
    ax.set(xlabel="round", ylabel="validation score", title="APO: prompt search")
    ax.set_xticks(list(rounds))
    return _save(plt, fig, ax, path, legend=True)


def _save(plt: Any, fig: Any, ax: Any, path: Path, legend: bool) -> Path:
    """The plots' one finish: a light grid, the legend, tight, 120 dpi, closed."""
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
