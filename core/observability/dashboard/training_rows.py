"""The training rows of a rollout and the advantage LocalRL's update gave each.

The rollout page rebuilds its rollout's rows with the run's trajectory settings and computes
each row's advantage over its step's batch with the update's own function
(``batch_advantages``); each row also keeps its GRPO group's mean and spread, the numbers that
explain its advantage (a row rewarded 0 gains when its group did worse on average).
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from voltrl.observability.dashboard.data import RunEntry, keep_newest
from voltrl.store.base import Store
from voltrl.store.browse import RolloutQuery
from voltrl.types import Rollout, Run


@dataclass
class Group:
    """A row's GRPO group in its update: the rows of its task (and agent group, with
    ``TrajectoryConfig.group_by_agent``) in the step's batch (of its LoRA adapter, with
    per-role adapters), their mean reward and standard deviation, as ``grpo_advantages``
    computes them (weighted per rollout with ``rollout_weighting``)."""

    group_id: str
    rows: int
    mean: float
    std: float


@dataclass
class TrainingRow:
    """One training row of a rollout, as the trainer saw it (token ids, not yet decoded)."""

    prompt: Sequence[int]
    response: Sequence[int]
    mask: Sequence[int]
    logprobs: list[float | None]
    reward: float | None
    advantage: float | None
    agent: str | None
    model: str | None = None
    """The model that sampled the row (with per-role LoRA adapters: the adapter it trains)."""
    group: Group | None = None
    """The row's GRPO group, where an advantage was computed."""
    weights: list[int] | None = None
    """The weights versions that sampled the row's calls (``LLM.weights_version``, in call
    order, repeats removed): more than one when the row spans a weight update
    (``LocalRL(schedule={"max_staleness": ...})``); None when the run published none."""


@dataclass
class Step:
    """The training rows of a step's rollouts and the advantage of each, as LocalRL's update
    computed them; ``note`` says how (or why there are none)."""

    rows: dict[str, list[TrainingRow]]
    dropped: dict[str, str]
    note: str


_STEPS: OrderedDict[tuple[str, int | str], Step] = OrderedDict()  # a finished step never changes
STEPS_KEPT = 16
"""Steps whose rows are kept (token ids as 32-bit arrays: a werewolf step is a few MB)."""
LOCAL_RL = "local_rl"


async def step_rows(entry: RunEntry, rollout: Rollout) -> Step:
    """The training rows of ``rollout``'s step (every train rollout of its run at its
    resources version, any status, as LocalRL's step batches them), rebuilt with the run's
    trajectory settings, and the advantage LocalRL's update gives each row in that batch.
    A validation rollout is its own step, with no advantages. Finished steps are kept
    (:data:`STEPS_KEPT`)."""
    from voltrl.observability.audit_views import recorded_trajectory
    from voltrl.trajectory import trajectories_from_store

    run = entry.run
    train = rollout.mode == "train" and rollout.resources_version is not None
    key = (
        (run.run_id, rollout.resources_version or 0) if train else (run.run_id, rollout.rollout_id)
    )
    if key in _STEPS:
        return _STEPS[key]
    try:
        trajectory = recorded_trajectory(run)
    except ValueError as e:
        return Step({}, {}, f"the run's trajectory settings do not load here: {e}")
    trajectory = trajectory.model_copy(update={"audit": "off"})  # the page shows, never warns
    retokenized = trajectory.missing_token_ids == "retokenize"
    if retokenized:  # needs the run's retokenizer: calls without token ids are left out here
        trajectory = trajectory.model_copy(update={"missing_token_ids": "drop"})
    mates, running = [rollout], False
    if train:
        mates = await _all_rollouts(
            entry.store,
            RolloutQuery(
                run_id=run.run_id, mode="train", resources_version=rollout.resources_version
            ),
        )
        running = any(not m.finished for m in mates)
        mates = [m for m in mates if m.finished] or [rollout]
    built = await trajectories_from_store(entry.store, mates, trajectory)
    rows: dict[str, list[TrainingRow]] = {}
    dropped: dict[str, str] = {}
    weights = await _weights_versions(entry.store, built)
    for t in built:
        if not t.transitions:
            dropped[t.rollout_id] = ", ".join(k for k in t.stats if k.startswith("dropped/"))
        rows[t.rollout_id] = [_row(tr, weights) for tr in t.transitions]
    if not train:
        step = Step(rows, dropped, f"{rollout.mode} rollouts are not trained on: no advantage")
        keep_newest(_STEPS, key, step, STEPS_KEPT)  # only finished rollouts have rows
        return step
    note = _advantages(run, trajectory, built, rows) + _sampled_note(rows)
    if running:
        note += "; the step is still running: over the rollouts finished so far"
    if retokenized:
        note += "; the run re-tokenised calls without token ids, which are left out here"
    step = Step(rows, dropped, note)
    if not running:
        keep_newest(_STEPS, key, step, STEPS_KEPT)
    return step


async def _all_rollouts(store: Store, query: RolloutQuery) -> list[Rollout]:
    """Every rollout matching ``query``, page by page."""
    found: list[Rollout] = []
    while True:
        page = await store.browse_rollouts(
            query.model_copy(update={"offset": len(found), "limit": 500})
        )
        found += page.rollouts
        if len(page.rollouts) < 500:
            return found


async def _weights_versions(store: Store, built: Sequence[Any]) -> dict[int, int]:
    """The weights version of every resources version the rows' calls recorded (those whose
    ``main_llm`` has one)."""
    versions = {
        v
        for t in built
        for tr in t.transitions
        for v in tr.metadata.get("resources_versions") or ()
        if v is not None
    }
    out: dict[int, int] = {}
    for version in sorted(versions):
        resources = await store.get_resources(version)
        llm = resources.items.get("main_llm") if resources is not None else None
        if getattr(llm, "weights_version", None) is not None:
            out[version] = llm.weights_version  # type: ignore[union-attr]
    return out


def _sampled_note(rows: dict[str, list[TrainingRow]]) -> str:
    """``; rows sampled by weights 3 (12 rows), 4 (4 rows)...``: the weights the step's rows
    came from, by their oldest call (empty when no row knows)."""
    counts: dict[int, int] = {}
    for row in (r for found in rows.values() for r in found):
        if row.weights:
            counts[min(row.weights)] = counts.get(min(row.weights), 0) + 1
    if not counts:
        return ""
    spanning = sum(len(r.weights or ()) > 1 for found in rows.values() for r in found)
    listed = ", ".join(f"{v} ({n} row{'s' * (n != 1)})" for v, n in sorted(counts.items()))
    across = f", {spanning} of them across an update" if spanning else ""
    return f"; rows sampled by weights version {listed}{across}"


def _row(t: Any, weights: dict[int, int]) -> TrainingRow:
    n = len(t.response_token_ids)
    lps = list(t.response_logprobs or [])
    sampled = [weights.get(v) for v in t.metadata.get("resources_versions") or ()]
    known = list(dict.fromkeys(v for v in sampled if v is not None)) or None
    return TrainingRow(
        prompt=array("q", t.prompt_token_ids),  # a tenth of a list's memory
        response=array("q", t.response_token_ids),
        mask=array("b", t.response_mask or [1] * n),
        logprobs=[lps[i] if i < len(lps) else None for i in range(n)],
        reward=t.reward,
        advantage=None,
        agent=t.agent_name,
        model=t.model,
        weights=known,
    )


def _advantages(
    run: Run, trajectory: Any, built: Sequence[Any], rows: dict[str, list[TrainingRow]]
) -> str:
    """Set each row's advantage as LocalRL's update computes it over the step's batch
    (``batch_advantages``, the update's own function); returns the note."""
    from voltrl.trajectory import collate

    if run.algorithm != LOCAL_RL or not isinstance(run.config.get("update"), dict):
        return f"advantages are shown for LocalRL runs (this one is {run.algorithm or run.kind})"
    try:
        from voltrl.algorithms.local.update import PolicyUpdateConfig, batch_advantages
    except ImportError:
        return "advantages need torch (pip install 'voltrl[local]')"
    try:
        batch = collate(built, trajectory)
        if not len(batch):
            return "no rollout of this step has a training row"
        config = PolicyUpdateConfig(**run.config["update"])
        parts = _parts(run, batch)
        values: list[float | None] = [None] * len(batch)
        groups_of: list[Group | None] = [None] * len(batch)
        for indices in parts.values():
            part = batch_advantages(batch.select(indices), config).tolist()
            for i, value in zip(indices, part, strict=True):
                values[i] = value
            for i, group in _groups(batch, indices, config.rollout_weighting).items():
                groups_of[i] = group
    except (ValueError, TypeError) as e:  # settings of another VoltRL version, say
        return f"advantages could not be computed here: {e}"
    seen: dict[str, int] = {}
    for k, (rid, value) in enumerate(zip(batch.rollout_ids, values, strict=True)):
        index = seen.get(rid, 0)
        seen[rid] = index + 1
        rows[rid][index].advantage = value
        rows[rid][index].group = groups_of[k]
    groups = len(set(batch.group_ids))
    if len(parts) == 1 and None in parts:
        return (
            f"advantages as LocalRL's update computed them over the step's batch "
            f"({len(batch)} rows, {groups} groups)"
        )
    sizes = ", ".join(f"{name} {len(i)}" for name, i in parts.items())
    return (
        f"advantages as LocalRL's update computed them, each LoRA adapter over its own rows "
        f"of the step's batch ({sizes} rows; rows of no adapter are not trained)"
    )


def _groups(batch: Any, indices: Sequence[int], weighted: bool) -> dict[int, Group]:
    """The GRPO group of each of the rows ``indices`` of ``batch`` (one trainer's rows):
    its size, mean and Bessel-corrected standard deviation, with each row weighted
    ``1 / rows of its rollout`` when ``weighted`` (``rollout_weighting``), as
    ``grpo_advantages`` computes them."""
    per_rollout: dict[str, int] = {}
    for i in indices:
        per_rollout[batch.rollout_ids[i]] = per_rollout.get(batch.rollout_ids[i], 0) + 1
    members: dict[str, list[int]] = {}
    for i in indices:
        members.setdefault(batch.group_ids[i], []).append(i)
    out: dict[int, Group] = {}
    for group_id, rows in members.items():
        w = [1.0 / per_rollout[batch.rollout_ids[i]] if weighted else 1.0 for i in rows]
        r = [batch.rewards[i] for i in rows]
        total = sum(w)
        mean = sum(wi * ri for wi, ri in zip(w, r, strict=True)) / total
        spread = sum(wi * (ri - mean) ** 2 for wi, ri in zip(w, r, strict=True))
        std = math.sqrt(spread / (total - 1)) if total > 1 else 0.0
        group = Group(group_id, len(rows), mean, std)
        out.update((i, group) for i in rows)
    return out


def _parts(run: Run, batch: Any) -> dict[str | None, list[int]]:
    """The rows each trainer of the run's update took: all of them, or, with per-role LoRA
    adapters, each adapter's (rows of no adapter are left out: not trained)."""
    mapping = run.config.get("lora_adapters")
    if not mapping:
        return {None: list(range(len(batch)))}
    from voltrl.models.lora import LoraAdapters

    serving = run.config.get("serving")  # a run of VoltRL 0.1 recorded it flat
    served = (serving if isinstance(serving, dict) else run.config).get("served_name") or ""
    parts = LoraAdapters.parse(mapping, served_name=str(served)).rows_by_adapter(batch)
    parts.pop(None, None)
    return parts


def credit_note(run: Run) -> str:
    """What a training row's reward and advantage are, in this run (the page's legend)."""
    settings = run.config.get("trajectory")
    credit = settings.get("credit", "final") if isinstance(settings, dict) else "final"
    update = run.config.get("update")
    update = update if isinstance(update, dict) else {}
    formula = (
        "(reward - group mean) / group std"
        if update.get("norm_adv_by_std", True)
        else "reward - group mean"
    )
    weighted = (
        " Rows count 1 / rows of their rollout (rollout_weighting), and each advantage is "
        "scaled by that weight."
        if update.get("rollout_weighting")
        else ""
    )
    return (
        f"reward: the row's credit under the run's trajectory settings (credit {credit!r}): "
        f"its agent's final reward, which is the last reward emitted for agents matching its "
        f"name (emit_reward(..., agents=...): a team's outcome, say) or else the rollout's "
        f"reward, plus the step and AIR rewards the settings add. advantage: {formula}, "
        f"GRPO over the row's group, the rows of the same task in the step's batch (of every "
        f"agent, unless per-role LoRA adapters split them).{weighted} So a row rewarded 0 "
        f"gains when its group did worse on average (other agents' penalties or lost games), "
        f"and a row rewarded 1 loses when its group did better."
    )


def advantage_note(row: TrainingRow) -> str:
    """A row's advantage in its group's numbers (its tooltip)."""
    group = row.group
    if row.advantage is None or group is None:
        return "no advantage computed for this row (see the note above)"
    r = row.reward or 0.0
    side = "above" if r > group.mean + 1e-9 else "below" if r < group.mean - 1e-9 else "at"
    return (
        f"reward {r:.3f} is {side} the mean {group.mean:.3f} of its group (the {group.rows} "
        f"rows of group {group.group_id} in the step's batch, std {group.std:.3f}): "
        f"advantage {row.advantage:.3f}"
    )
