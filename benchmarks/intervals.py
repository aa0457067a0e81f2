"""95% intervals of a mean over seeds (Student's t), for the benchmarks' tables."""

from __future__ import annotations

import math
import statistics

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
"""Student's t, 97.5th percentile, by degrees of freedom (10 and more: 2.228 and less)."""


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% interval over seeds (nan with one seed: unknown)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    t = T_975.get(len(values) - 1, 2.228)
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))
