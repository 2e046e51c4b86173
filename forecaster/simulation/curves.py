"""Comparisons at equal cost (EVALUATION.md sections 2-3, v2): a tunable policy is a curve of points on a grid
fixed before the run, and two policies are compared by reading each curve at the same cost.

A curve is a list of points ``(x, y)`` in grid order (keep-alive length, cold cost, ...), both axes "lower is
better" (waste or GPU-seconds; cold % or wait). :func:`value_at` reads ``y`` at a given ``x`` by linear
interpolation along the curve's segments; :func:`cost_at` reads ``x`` at a given ``y``. Outside the range a curve
covers the answer is None: a curve is never extrapolated. Where a curve crosses the value more than once (it is
not monotone on that axis), the best (lowest) reading is returned: what the policy attains at that cost.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def _clean(points: Iterable[Sequence[float | None]]) -> list[tuple[float, float]]:
    out = []
    for p in points:
        if p is None or len(p) < 2 or p[0] is None or p[1] is None:
            continue
        x, y = float(p[0]), float(p[1])
        if math.isfinite(x) and math.isfinite(y):
            out.append((x, y))
    return out


def _read(points: list[tuple[float, float]], at: float, axis: int) -> float | None:
    other = 1 - axis
    hits = []
    for a, b in zip(points, points[1:]):
        lo, hi = sorted((a[axis], b[axis]))
        if not lo <= at <= hi:
            continue
        if hi == lo:
            hits.append(min(a[other], b[other]))
        else:
            w = (at - a[axis]) / (b[axis] - a[axis])
            hits.append(a[other] + w * (b[other] - a[other]))
    hits += [p[other] for p in points if p[axis] == at]  # a single point, or a grid point hit exactly
    return min(hits) if hits else None


def value_at(points: Iterable[Sequence[float | None]], x: float | None) -> float | None:
    """``y`` of the curve at ``x`` (linear between neighbouring grid points); None outside its ``x`` range."""
    if x is None or not math.isfinite(float(x)):
        return None
    return _read(_clean(points), float(x), 0)


def cost_at(points: Iterable[Sequence[float | None]], y: float | None) -> float | None:
    """``x`` at which the curve reaches ``y`` (the lowest such cost); None outside its ``y`` range."""
    if y is None or not math.isfinite(float(y)):
        return None
    return _read(_clean(points), float(y), 1)


def best_within(points: Iterable[Sequence[float | None]], x_max: float | None) -> float | None:
    """Lowest ``y`` the curve attains at a cost of at most ``x_max``: over its points at ``x <= x_max`` and its
    reading at ``x_max`` itself; None when no point costs that little.

    "p99 at <= 0.6x reactive's GPU-seconds" asks this, not :func:`value_at`: a curve that reaches its lowest
    wait below that cost and ends there (the planner holds nothing more at any cold cost) meets it at its end,
    where reading at exactly ``0.6x`` would be an extrapolation.
    """
    if x_max is None or not math.isfinite(float(x_max)):
        return None
    clean = _clean(points)
    hits = [y for x, y in clean if x <= x_max]
    at = _read(clean, float(x_max), 0)
    if at is not None:
        hits.append(at)
    return min(hits) if hits else None


def gap_closed(reference: float | None, policy: float | None, anchor: float | None) -> float | None:
    """Share of the ``reference``-to-``anchor`` gap a policy closes: (reference - policy) / (reference - anchor).

    1 = as good as the anchor (the oracle), 0 = no better than the reference (the hybrid), negative = worse.
    None when a value is missing or the gap is zero.
    """
    if reference is None or policy is None or anchor is None or reference == anchor:
        return None
    return (reference - policy) / (reference - anchor)
