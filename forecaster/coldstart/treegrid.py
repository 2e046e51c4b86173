"""A LightGBM booster evaluated on a grid of (row, column) pairs without building the rows x columns matrix.

The latency model's per-node table asks the total booster for every (model,
state) x node pair: 25.6 M feature rows at 100,000 models and 64 nodes, about
two minutes of LightGBM on two cores and gigabytes of rows. But each feature of
such a pair comes either from the model side (sizes, the model's own history,
the prior at the node's bandwidth) or from the node side (the node's speed
statistics), never from both. A tree's split then is decided by one side
alone, so for a row r and a column c

    tree(r, c) = sum over leaves l of value_l * [r can reach l] * [c can reach l]

where "can reach" follows only the splits on that side's features and passes
both ways at the other side's splits: exactly one leaf is reachable from both
(the one LightGBM would land in). Summed over trees, with leaves whose column
reach pattern is the same merged into one column, the booster's raw score is
the matrix product ``A @ C`` of a (rows x patterns) and a (patterns x columns)
matrix: exact up to floating-point summation order (about 1e-15 relative),
and linear in rows + columns instead of their product.

:class:`TreeGrid` decodes the booster's trees from ``dump_model()`` and
follows LightGBM's numerical decision rule (missing values as ``missing_type``
and ``default_left`` say, NaN read as 0 where missing values are not
special). A booster it cannot evaluate this way (a categorical split, several
trees per iteration; the latency model's boosters have neither) raises
:class:`UnsupportedBooster`, and the caller predicts row by row with the
booster itself (:meth:`forecaster.coldstart.model.ColdStartModel.node_latency_table`).
"""

from __future__ import annotations

from dataclasses import dataclass

import lightgbm as lgb
import numpy as np

#: LightGBM's kZeroThreshold (a float constant, 1e-35f): |x| at most this counts as zero for missing_type Zero.
ZERO_THRESHOLD = float(np.float32(1e-35))


#: Column sides :class:`TreeGrid` keeps (a table asks one per start state and node bandwidth).
COLUMN_SIDES_KEPT = 16


class UnsupportedBooster(ValueError):
    """The booster has a tree :class:`TreeGrid` cannot evaluate on a grid (the caller falls back to row by row)."""


@dataclass(frozen=True)
class _Split:
    feature: int
    threshold: float
    default_left: bool
    missing: str  # "None", "Zero" or "NaN"

    def left(self, x: np.ndarray) -> np.ndarray:
        """Rows of ``x`` (one feature column) that go left, as LightGBM's NumericalDecision decides."""
        nan = np.isnan(x)
        if self.missing == "NaN":
            return np.where(nan, self.default_left, x <= self.threshold)
        x = np.where(nan, 0.0, x)
        if self.missing == "Zero":
            zero = (x >= -ZERO_THRESHOLD) & (x <= ZERO_THRESHOLD)
            return np.where(zero, self.default_left, x <= self.threshold)
        return x <= self.threshold


def _decode(node: dict, splits: list, children: list, values: list) -> int:
    """Flatten one tree: internal nodes get ids >= 0, leaves ~leaf (negative); returns this node's id."""
    if "leaf_value" in node:
        values.append(float(node["leaf_value"]))
        return ~(len(values) - 1)
    if node.get("decision_type", "<=") != "<=":
        raise UnsupportedBooster(f"split {node.get('decision_type')!r} (categorical) has no grid form")
    at = len(splits)
    splits.append(_Split(int(node["split_feature"]), float(node["threshold"]), bool(node["default_left"]),
                         str(node.get("missing_type", "None"))))
    children.append(None)
    children[at] = (_decode(node["left_child"], splits, children, values),
                    _decode(node["right_child"], splits, children, values))
    return at


class TreeGrid:
    """The raw score of ``booster`` (the sum of its trees' leaf values) on every (row, column) pair of a grid."""

    def __init__(self, booster: lgb.Booster):
        dump = booster.dump_model()
        if dump.get("num_tree_per_iteration", 1) != 1:
            raise UnsupportedBooster(f"{dump['num_tree_per_iteration']} trees per iteration: only regression "
                                     "boosters (one tree per iteration) have a grid form")
        self.n_features = int(dump["max_feature_idx"]) + 1
        self._kept_column_sides: dict[tuple, tuple] = {}  # :meth:`_column_side`'s answers, by its columns
        self.trees = []
        for info in dump["tree_info"]:
            splits: list[_Split] = []
            children: list = []
            values: list[float] = []
            root = _decode(info["tree_structure"], splits, children, values)
            self.trees.append((root, splits, children, np.asarray(values, dtype="float64")))

    def _reach(self, tree, x: np.ndarray, decided: np.ndarray) -> list[np.ndarray | None]:
        """Per leaf, which rows of ``x`` can reach it (splits on undecided features pass both ways); None: all."""
        root, splits, children, values = tree
        reach: list[np.ndarray | None] = [None] * len(values)
        stack = [(root, None)]
        while stack:
            node, rows = stack.pop()
            if node < 0:
                reach[~node] = rows
                continue
            split = splits[node]
            left, right = children[node]
            if not decided[split.feature]:
                stack.append((left, rows))
                stack.append((right, rows))
                continue
            go = split.left(x[:, split.feature])
            stack.append((left, go if rows is None else rows & go))
            stack.append((right, ~go if rows is None else rows & ~go))
        return reach

    def _column_side(self, columns: np.ndarray, on_column: np.ndarray) -> tuple[list, list, np.ndarray]:
        """Each leaf's reach pattern over the columns, equal patterns merged: (patterns, per tree the pattern id of
        each leaf (-1: no column lands there), the (patterns x columns) matrix ``C``).

        Answers are kept (the :data:`COLUMN_SIDES_KEPT` newest columns): the columns are the fleet's nodes per
        start state, the same for every question until the node statistics change, and for a question about one
        model they are half the work.
        """
        key = (columns.shape, columns.tobytes(), on_column.tobytes())
        kept = self._kept_column_sides.get(key)
        if kept is not None:
            return kept
        pattern_of: dict[bytes, int] = {}
        patterns: list[np.ndarray] = []
        leaf_patterns = []
        for tree in self.trees:
            ids = []
            for reach in self._reach(tree, columns, on_column):
                mask = np.ones(len(columns), dtype=bool) if reach is None else reach
                if not mask.any():
                    ids.append(-1)  # no column lands here: the leaf adds nothing
                    continue
                mask_key = mask.tobytes()
                if mask_key not in pattern_of:
                    pattern_of[mask_key] = len(patterns)
                    patterns.append(mask)
                ids.append(pattern_of[mask_key])
            leaf_patterns.append(ids)
        c = np.stack(patterns).astype("float64") if patterns else np.zeros((0, len(columns)))
        if len(self._kept_column_sides) >= COLUMN_SIDES_KEPT:
            self._kept_column_sides.clear()
        self._kept_column_sides[key] = (patterns, leaf_patterns, c)
        return patterns, leaf_patterns, c

    def grid(self, rows: np.ndarray, columns: np.ndarray, column_features, *, chunk_cells: int = 1 << 22
             ) -> np.ndarray:
        """(R, C) float64 raw scores: row ``r`` and column ``c`` combined into one feature vector.

        Args:
            rows: (R, F) features; only those not in ``column_features`` are read.
            columns: (C, F) features; only those in ``column_features`` are read.
            column_features: indices of the features the columns supply.
            chunk_cells: rows are processed in chunks of about this many (row, pattern) cells (memory bound).
        """
        rows = np.asarray(rows, dtype="float64")
        columns = np.asarray(columns, dtype="float64")
        on_column = np.zeros(self.n_features, dtype=bool)
        on_column[list(column_features)] = True
        patterns, leaf_patterns, c = self._column_side(columns, on_column)
        out = np.empty((len(rows), len(columns)), dtype="float64")
        step = max(256, chunk_cells // max(len(patterns), 1))
        on_row = ~on_column
        for start in range(0, len(rows), step):
            part = rows[start:start + step]
            a = np.zeros((len(patterns), len(part)), dtype="float64")
            for tree, ids in zip(self.trees, leaf_patterns):
                values = tree[3]
                for leaf, reach in enumerate(self._reach(tree, part, on_row)):
                    p = ids[leaf]
                    if p < 0:
                        continue
                    if reach is None:
                        a[p] += values[leaf]
                    else:
                        a[p] += reach * values[leaf]
            out[start:start + step] = a.T @ c
        return out
