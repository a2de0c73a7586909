"""Seed statistics shared by the experiments: a mean with a 95% interval, and a per-seed -> summary aggregator.

    from stemlm.experiments.stats import mean_ci95, summarize_seeds, format_ci
    mean_ci95([0.22, 0.80, 0.49])            # {"mean": 0.503, "ci95": [-0.217, 1.224], "n": 3, "sd": 0.290}
    summarize_seeds([{"dense": {"loss": 5.1}}, {"dense": {"loss": 5.3}}])
                                             # {"dense": {"loss": {"mean": 5.2, "ci95": [...], ...}}}

The interval is Student's t over seeds: mean ± t(0.975, n-1) · sd / sqrt(n), with sd the sample standard
deviation (n-1). Why t over seeds and not a bootstrap: the seed is the unit that is replicated (it changes the
initialisation, the data order and the edit records at once), and the issue this answers is that one seed's
result did not hold on the next; a bootstrap over items inside a seed would shrink the interval by the number
of items while ignoring exactly that between-seed variance, and a bootstrap over 2-3 seeds is degenerate (it
has at most 10 distinct resamples and under-covers). The t interval is wide at 2-3 seeds (t = 12.7 at n = 2,
4.3 at n = 3); that width is the honest statement of what so few seeds can show. With one seed (or one
non-missing value) there is no interval: `ci95` is [None, None].
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from scipy.stats import t as student_t


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def mean_ci95(values: Iterable[float | None]) -> dict[str, Any]:
    """{"mean", "ci95": [lo, hi], "n", "sd"} over the non-missing finite values (None / NaN are skipped).

    No values: mean None. One value: ci95 [None, None] and sd None (one seed has no spread to measure)."""
    xs = [float(v) for v in values if _number(v)]
    n = len(xs)
    if n == 0:
        return {"mean": None, "ci95": [None, None], "n": 0, "sd": None}
    mean = sum(xs) / n
    if n == 1:
        return {"mean": mean, "ci95": [None, None], "n": 1, "sd": None}
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = float(student_t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": n, "sd": sd}


def summarize_seeds(per_seed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The summary of a list of per-seed result dicts: the same nesting, every numeric leaf -> `mean_ci95`.

    A leaf is summarised when it is a number (bools are not) in at least one seed; seeds where it is missing
    or None are skipped (the entry's `n` says how many seeds it covers). Lists, strings and None-only leaves
    are left out: the summary holds only what can be averaged."""
    keys: list[str] = []
    for seed in per_seed:
        keys += [k for k in seed if k not in keys]
    summary: dict[str, Any] = {}
    for key in keys:
        values = [seed.get(key) for seed in per_seed]
        if any(isinstance(v, dict) for v in values):
            nested = summarize_seeds([v for v in values if isinstance(v, dict)])
            if nested:
                summary[key] = nested
        elif any(_number(v) for v in values):
            summary[key] = mean_ci95(values)
    return summary


def format_ci(entry: dict[str, Any] | None, digits: int = 3) -> str:
    """Format a `mean_ci95` entry as "m ± h" (h = half the interval); "m (1 seed)" or "n/a" without one."""
    if not entry or entry.get("mean") is None:
        return "n/a"
    mean = entry["mean"]
    lo, hi = entry["ci95"]
    if lo is None:
        return f"{mean:.{digits}f} (1 seed)"
    return f"{mean:.{digits}f} ± {(hi - lo) / 2:.{digits}f}"


def format_seeds(values: Iterable[float | None], digits: int = 3) -> str:
    """The per-seed values as "a / b / c" (missing ones as "-"), to print beside `format_ci`."""
    return " / ".join("-" if not _number(v) else f"{v:.{digits}f}" for v in values)
