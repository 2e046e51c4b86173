"""bench/planner_validation.py's comparison of two runs: the other curve read at this run's points, never beyond."""

from __future__ import annotations

import pytest

from bench import planner_validation


def _row(cost: float, waste: float, p75: float, p99: float) -> dict:
    return {"cold_cost": cost, "wasted_norm_pct": waste, "cold_pct_p75": p75, "wait_p99_s": p99,
            "cold_pct_overall": p75 / 10, "slo_attainment": 1 - p75 / 100}


def test_against_reads_the_other_curve_at_each_point_and_never_extrapolates():
    mine = {"rows": {"hybrid_histogram": _row(0, 150.0, 20.0, 9.0), "prewarm_k1": _row(1, 60.0, 60.0, 15.0),
                     "prewarm_k4": _row(4, 100.0, 30.0, 12.0), "prewarm_k16": _row(16, 140.0, 10.0, 3.0)}}
    theirs = {"rows": {"prewarm_k1": _row(1, 80.0, 50.0, 14.0), "prewarm_k4": _row(4, 120.0, 20.0, 10.0),
                       "prewarm_k16": _row(16, 160.0, 5.0, 2.0)}}
    lines = {line["point"]: line for line in planner_validation.against(mine, theirs)}
    assert set(lines) == {"prewarm_k1", "prewarm_k4", "prewarm_k16"}
    assert lines["prewarm_k1"]["cold_pct_p75"] == (60.0, None)  # 60 % is below the other curve's least waste
    assert lines["prewarm_k4"]["cold_pct_p75"] == (30.0, pytest.approx(35.0))  # halfway from 80 % to 120 %
    assert lines["prewarm_k16"]["wait_p99_s"] == (3.0, pytest.approx(6.0))
    assert planner_validation.fmt(None, ".1f") == "n/a" and planner_validation.fmt(2.345, ".1f") == "2.3"
