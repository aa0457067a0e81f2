"""Which rows go through the model together: a batch's rows split into micro-batches.

A micro-batch is fed as one padded tensor: its rows' prompts left-padded to the longest,
their responses cut after the last trained token of any of them, and the prompt tokens all
its rows start with fed once (:func:`~.prefix_cache.split_common_prefix`).
Which rows share a micro-batch decides how many tokens that costs: an agent's ``write`` and
``check`` calls share little of their prompts, two calls of one agent share its system prompt
and tools, the rollouts of one GRPO group share the whole task prompt.
:func:`plan_micro_batches` picks a split that feeds few tokens (the cheapest cut of two
orders of the rows); the policy update and SFT both use it, and the gradient does not depend
on the split (each micro-batch's loss is divided by the whole batch's normaliser).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from voltrl.models.kv_cache import MIN_SHARED_PREFIX

PASS_COST = 64
"""What one more forward pass costs, in tokens fed: the fixed cost of a pass (kernel
launches, Python), which keeps the plan from splitting rows apart to save a few columns."""


def plan_micro_batches(
    prompts: Sequence[Sequence[int]],
    ends: Sequence[int],
    *,
    max_rows: int,
    max_tokens: int | None = None,
    share_prefix: bool = True,
) -> list[list[int]]:
    """Split rows ``0..n-1`` into micro-batches that feed the model the fewest tokens.

    Row ``i`` is the prompt ``prompts[i]`` (its real tokens) then ``ends[i]`` response
    columns. A micro-batch ``G`` of rows with longest prompt ``P``, longest response ``E``
    and ``L`` prompt tokens in common (when ``share_prefix``, as ``split_common_prefix`` takes
    them: at least :data:`~.prefix_cache.MIN_SHARED_PREFIX`, at most one less
    than its shortest prompt; else 0) costs::

        cost(G) = PASS_COST + L + |G| * (P - L + E)       tokens fed, the prefix once
                  (+ PASS_COST when L > 0: the prefix is a forward pass of its own)

    Two orders of the rows are each cut into runs of at most ``max_rows`` rows and, when
    given, ``max_tokens`` padded tokens (``|G| * (P + E)``; a row alone always fits) where
    the total cost is least (dynamic programming over the cut points), and the cheaper plan
    is returned: rows by length (little padding: what packing by length alone gives, or
    better) and, when ``share_prefix``, rows by their prompt tokens (rows that share a
    prefix are neighbours: an agent's calls, a GRPO group's identical prompts). Returns the
    micro-batches as lists of row indices; every row is in exactly one.
    """
    n = len(prompts)
    if len(ends) != n:
        raise ValueError(f"{n} prompts but {len(ends)} response ends")
    if max_rows < 1:
        raise ValueError("max_rows must be at least 1")
    orders = [sorted(range(n), key=lambda i: (len(prompts[i]) + ends[i], i))]
    if share_prefix:
        orders.append(sorted(range(n), key=lambda i: (tuple(prompts[i]), ends[i], i)))
    plans = [_cut(order, prompts, ends, max_rows, max_tokens, share_prefix) for order in orders]
    return min(plans, key=lambda plan: plan[0])[1]


def _cut(
    order: list[int],
    prompts: Sequence[Sequence[int]],
    ends: Sequence[int],
    max_rows: int,
    max_tokens: int | None,
    share_prefix: bool,
) -> tuple[float, list[list[int]]]:
    """The cheapest cut of ``order`` into micro-batches, and its cost."""
    n = len(order)
    # shared[k]: how many leading tokens the prompts of order[k] and order[k + 1] share
    shared = [0] * max(n - 1, 0)
    if share_prefix:
        shared = [_common_length(prompts[a], prompts[b]) for a, b in itertools.pairwise(order)]
    best = [0.0] + [float("inf")] * n  # best[j]: least cost of the first j rows of order
    cut = [0] * (n + 1)  # cut[j]: where the last micro-batch of that best split starts
    for i in range(n):
        longest = shortest = len(prompts[order[i]])
        end = ends[order[i]]
        common = longest  # tokens every prompt of order[i..j] starts with
        for j in range(i + 1, min(n, i + max_rows) + 1):
            k = order[j - 1]
            if j > i + 1:
                common = min(common, shared[j - 2])
                longest = max(longest, len(prompts[k]))
                shortest = min(shortest, len(prompts[k]))
                end = max(end, ends[k])
            rows = j - i
            if max_tokens is not None and rows > 1 and rows * (longest + end) > max_tokens:
                break
            prefix = min(common, shortest - 1) if share_prefix and rows > 1 else 0
            prefix = prefix if prefix >= MIN_SHARED_PREFIX else 0
            passes = 2 if prefix else 1
            cost = best[i] + passes * PASS_COST + prefix + rows * (longest - prefix + end)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups: list[list[int]] = []
    j = n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return best[n], groups[::-1]


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (slices compared whole, a binary search
    over their length: long identical prompts cost a few comparisons, not one per token)."""
    a, b = list(a), list(b)
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; the answer is in [lo, hi]
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
