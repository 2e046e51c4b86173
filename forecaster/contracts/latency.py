"""The per-node latency table as arrays: predicted cold-start seconds per (model, node, start state).

The latency model answers, for every model of the catalogue, every node of
the fleet and every start state, how long a cold start would take. At 100,000
models x 64 nodes x 4 states that is 25.6 M numbers: as a long pandas frame
(object ids on every row) it was gigabytes; here it is one float32 array of
``models x nodes x states`` (4 bytes a cell, about 100 MB at that size) plus
the node-independent phases (``models x states`` each). The planner reduces
it per minute with array operations (:func:`forecaster.planning.fleet.node_latency`).

:meth:`NodeLatencyTable.to_frame` gives the long frame the older interfaces
read (one row per model, node and state), for small tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from forecaster.contracts.phases import PHASES, START_STATES


@dataclass(frozen=True)
class NodeLatencyTable:
    """Predicted seconds per model, node and start state (:data:`START_STATES`, coldest first).

    Attributes:
        model_ids: (M,) model ids (strings, unique).
        node_ids: (K,) node ids (strings, unique).
        per_node: column name -> (M, K, S) float32 seconds (always ``total_s``); NaN where nothing is known.
        per_model: column name -> (M, S) float32 seconds of columns that do not depend on the node (the
            phases of the latency model), or an empty dict.

    The arrays are read-only: one table is shared by every reader of the per-hour cache.
    """

    model_ids: pd.Index
    node_ids: pd.Index
    per_node: dict[str, np.ndarray]
    per_model: dict[str, np.ndarray]

    def __post_init__(self) -> None:
        m, k, s = len(self.model_ids), len(self.node_ids), len(START_STATES)
        if "total_s" not in self.per_node:
            raise ValueError("a node latency table needs a per-node total_s")
        if self.model_ids.has_duplicates or self.node_ids.has_duplicates:
            raise ValueError("model and node ids of a node latency table must be unique")
        for name, values in self.per_node.items():
            if values.shape != (m, k, s):
                raise ValueError(f"{name}: shape {values.shape}, expected {(m, k, s)} (models, nodes, states)")
            values.flags.writeable = False
        for name, values in self.per_model.items():
            if values.shape != (m, s):
                raise ValueError(f"{name}: shape {values.shape}, expected {(m, s)} (models, states)")
            values.flags.writeable = False

    @property
    def total_s(self) -> np.ndarray:
        """(M, K, S) predicted total seconds."""
        return self.per_node["total_s"]

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (what the per-hour cache counts)."""
        return int(sum(v.nbytes for v in (*self.per_node.values(), *self.per_model.values())))

    def to_frame(self) -> pd.DataFrame:
        """The long frame: ``model_id, node_id, state, total_s`` and the other columns, one row per cell.

        Row order is node, then model, then state (the order the latency model's long table always had).
        Meant for small tables (the API asking about one node or a few models); the planner reads the arrays.
        """
        m, k, s = len(self.model_ids), len(self.node_ids), len(START_STATES)
        out = pd.DataFrame({
            "model_id": np.tile(np.repeat(self.model_ids.astype(str).to_numpy(dtype=object), s), k),
            "node_id": np.repeat(self.node_ids.astype(str).to_numpy(dtype=object), m * s),
            "state": np.tile(np.asarray(START_STATES, dtype=object), m * k),
        })
        for name, values in self.per_node.items():
            out[name] = values.transpose(1, 0, 2).reshape(-1).astype("float64")
        for name in (*PHASES, *sorted(set(self.per_model) - set(PHASES))):
            if name in self.per_model:
                out[name] = np.tile(self.per_model[name].reshape(-1), k).astype("float64")
        return out

    def for_node(self, node_id: str) -> pd.DataFrame:
        """One row per (model, state) on ``node_id``: ``model_id, state, total_s`` and the phases (no node column)."""
        pos = self.node_ids.get_indexer([str(node_id)])[0]
        if pos < 0:
            raise KeyError(f"node {node_id!r} is not in the latency table")
        m, s = len(self.model_ids), len(START_STATES)
        out = pd.DataFrame({"model_id": np.repeat(self.model_ids.astype(str).to_numpy(dtype=object), s),
                            "state": np.tile(np.asarray(START_STATES, dtype=object), m)})
        for name, values in self.per_node.items():
            out[name] = values[:, pos, :].reshape(-1).astype("float64")
        for name, values in self.per_model.items():
            out[name] = values.reshape(-1).astype("float64")
        return out

    @staticmethod
    def from_frame(latency: pd.DataFrame) -> "NodeLatencyTable":
        """Arrays from a long per-node frame (``model_id, node_id, state, total_s`` [, phases]).

        Every value column becomes a per-node array (a hand-built frame may give phases per node); a (model,
        node, state) missing from the frame is NaN. Raises ValueError on duplicate (model, node, state) rows
        or an unknown state.
        """
        missing = [c for c in ("model_id", "node_id", "state", "total_s") if c not in latency.columns]
        if missing:
            raise ValueError(f"latency lacks columns {missing}")
        models = pd.Index(pd.unique(latency["model_id"].astype(str)))
        nodes = pd.Index(pd.unique(latency["node_id"].astype(str)))
        m = models.get_indexer(latency["model_id"].astype(str))
        n = nodes.get_indexer(latency["node_id"].astype(str))
        s = pd.Index(START_STATES).get_indexer(latency["state"].astype(str))
        if (s < 0).any():
            bad = sorted(set(latency["state"].astype(str)) - set(START_STATES))
            raise ValueError(f"unknown start states {bad}; expected some of {list(START_STATES)}")
        flat = (m * len(nodes) + n) * len(START_STATES) + s
        if len(np.unique(flat)) != len(flat):
            raise ValueError("latency has duplicate (model_id, node_id, state) rows")
        per_node = {}
        for column in ("total_s", *PHASES):
            if column in latency.columns:
                values = np.full(len(models) * len(nodes) * len(START_STATES), np.nan)  # float64: exact
                values[flat] = pd.to_numeric(latency[column], errors="coerce").to_numpy(dtype="float64")
                per_node[column] = values.reshape(len(models), len(nodes), len(START_STATES))
        return NodeLatencyTable(model_ids=models, node_ids=nodes, per_node=per_node, per_model={})
