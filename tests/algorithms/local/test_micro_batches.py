"""Which rows go through the model together (plan_micro_batches)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest

from voltrl.algorithms.local.micro_batches import PASS_COST, plan_micro_batches

WRITER = list(range(100, 140))  # two agents' system prompts: 40 tokens, none in common
REVIEWER = list(range(200, 240))


def cost(prompts: list[list[int]], ends: list[int], group: list[int], share: bool = True) -> int:
    """Tokens fed for ``group``, as the plan counts them (written out independently)."""
    rows = [prompts[i] for i in group]
    common = 0
    while all(len(r) > common and r[common] == rows[0][common] for r in rows):
        common += 1
    prefix = min(common, min(map(len, rows)) - 1) if share and len(rows) > 1 else 0
    prefix = prefix if prefix >= 16 else 0
    longest, end = max(map(len, rows)), max(ends[i] for i in group)
    passes = 2 if prefix else 1  # the prefix is a pass of its own
    return passes * PASS_COST + prefix + len(rows) * (longest - prefix + end)


def test_every_row_is_in_exactly_one_micro_batch_of_at_most_max_rows() -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(5)] * rng.randrange(1, 40) for _ in range(37)]
    ends = [rng.randrange(1, 30) for _ in prompts]
    for max_rows in (1, 4, 37, 100):
        plan = plan_micro_batches(prompts, ends, max_rows=max_rows)
        assert sorted(i for group in plan for i in group) == list(range(37))
        assert all(1 <= len(group) <= max_rows for group in plan)


def test_two_agents_rows_are_fed_as_two_micro_batches_each_sharing_its_system_prompt() -> None:
    """Interleaved calls of two agents whose system prompts differ from the first token: one
    micro-batch per agent, each feeding its 40-token prompt once, beats one mixed batch."""
    prompts = [[*(WRITER if k % 2 else REVIEWER), k] for k in range(12)]
    ends = [5] * 12
    plan = plan_micro_batches(prompts, ends, max_rows=32)
    assert sorted(map(sorted, plan)) == [list(range(0, 12, 2)), list(range(1, 12, 2))]
    mixed = cost(prompts, ends, list(range(12)))
    assert sum(cost(prompts, ends, g) for g in plan) < mixed
    # the same rows, but a model that cannot share a prefix's cache: one batch, no split
    assert len(plan_micro_batches(prompts, ends, max_rows=32, share_prefix=False)) == 1


def test_a_grpo_groups_identical_prompts_go_together_ordered_by_response_length() -> None:
    prompts = [[*WRITER, *[1] * 30]] * 4 + [[*WRITER, *[2] * 30]] * 4  # two tasks, 4 rollouts
    ends = [9, 3, 7, 1, 2, 8, 4, 6]
    plan = plan_micro_batches(prompts, ends, max_rows=4)
    assert plan == [[3, 1, 2, 0], [4, 6, 7, 5]]


def test_rows_of_very_different_lengths_are_split_when_padding_costs_more_than_a_pass() -> None:
    short, long = [[7] * 10] * 4, [[7] * 10 + [8] * 300] * 4
    plan = plan_micro_batches(short + long, [2] * 8, max_rows=8, share_prefix=False)
    assert sorted(map(sorted, plan)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # a few columns of padding are not worth a pass
    plan = plan_micro_batches([[7] * 10, [7] * 12], [2, 2], max_rows=8, share_prefix=False)
    assert len(plan) == 1


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_never_feeds_more_than_packing_rows_by_length(seed: int) -> None:
    """What the update did before planning: rows sorted by length, cut every max_rows."""
    rng = random.Random(seed)
    system = [WRITER, REVIEWER, WRITER[:20]]
    prompts = [
        rng.choice(system) + [rng.randrange(9) for _ in range(rng.choice([2, 5, 300]))]
        for _ in range(rng.randrange(2, 40))
    ]
    ends = [rng.randrange(1, 60) for _ in prompts]
    max_rows = rng.choice([1, 2, 4, 8, 64])
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + ends[i])
    packed = [by_length[k : k + max_rows] for k in range(0, len(prompts), max_rows)]
    plan = plan_micro_batches(prompts, ends, max_rows=max_rows)
    assert sum(cost(prompts, ends, g) for g in plan) <= sum(cost(prompts, ends, g) for g in packed)


def test_one_agents_short_and_long_questions_are_not_padded_to_one_another() -> None:
    """One system prompt, questions alternately short and long: ordering by prompt tokens
    alone would interleave them; the plan packs the long ones together and the short ones."""
    prompts = [[*WRITER, k, *([k] * (1000 if k % 2 else 10))] for k in range(8)]
    plan = plan_micro_batches(prompts, [4] * 8, max_rows=4)
    assert sorted(map(sorted, plan)) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_the_token_budget_caps_padded_tokens_but_a_row_alone_always_fits() -> None:
    prompts = [[k] * (10 + k) for k in range(10)]
    ends = [5] * 10
    plan = plan_micro_batches(prompts, ends, max_rows=10, max_tokens=60)
    for group in plan:
        if len(group) > 1:
            assert len(group) * (max(len(prompts[i]) for i in group) + 5) <= 60
    assert plan_micro_batches([[1] * 100], [50], max_rows=4, max_tokens=10) == [[0]]


def test_the_plan_is_the_cheapest_cut_of_its_order() -> None:
    """Against every way of cutting the ordered rows into runs (brute force, 8 rows)."""
    rng = random.Random(1)
    system = [[*WRITER], [*REVIEWER], [*WRITER[:20], 1, 2, 3]]
    prompts = [rng.choice(system) + [rng.randrange(3)] * rng.randrange(1, 30) for _ in range(8)]
    ends = [rng.randrange(1, 40) for _ in prompts]
    plan = plan_micro_batches(prompts, ends, max_rows=5)
    order = [i for group in plan for i in group]

    def cuts() -> Iterator[list[list[int]]]:
        for mask in range(2**7):
            bounds = [0, *(k + 1 for k in range(7) if mask >> k & 1), 8]
            runs = [order[a:b] for a, b in itertools.pairwise(bounds)]
            if all(len(run) <= 5 for run in runs):
                yield runs

    best = min(sum(cost(prompts, ends, run) for run in runs) for runs in cuts())
    assert sum(cost(prompts, ends, g) for g in plan) == best


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="2 prompts but 1 response ends"):
        plan_micro_batches([[1], [2]], [1], max_rows=2)
    with pytest.raises(ValueError, match="max_rows"):
        plan_micro_batches([[1]], [1], max_rows=0)
