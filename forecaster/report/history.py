"""The report's input: per-minute counts of the operator's models over a window (plus history before it), their
catalogue as the simulator's model table, and the fleet the store knows.

Errors a user can fix (a bad ``--since``, unknown models, no data in the window) raise :class:`ReportError` with a
message that says what was asked and what the store holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np
import pandas as pd
from sqlalchemy import Engine

from forecaster.contracts.fleet import MAX_COLD_COST
from forecaster.contracts.fleetconfig import FleetConfig
from forecaster.simulation.catalog import load_catalog
from forecaster.store.fields import MAX_REQUEST_S
from forecaster.store.history import node_shapes, read_catalogue, stored_span
from forecaster.store.invocations import read_grid

MINUTE = pd.Timedelta(minutes=1)
DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([wdhm])\s*$", re.IGNORECASE)
UNITS_MIN = {"w": 7 * 1440, "d": 1440, "h": 60, "m": 1}
#: request seconds the reactive autoscaler assumes when neither a label nor the simulator catalogue gives one
DEFAULT_REQUEST_S = 1.0
#: requests per second of one replica when the catalogue has none (the fleet builder's 60 per minute)
DEFAULT_REPLICA_RPS = 1.0


class ReportError(ValueError):
    """A report that cannot be made from what was asked (the message says why and what would work)."""


def parse_moment(value: str, *, option: str, reference: pd.Timestamp | None = None) -> pd.Timestamp:
    """``7d`` / ``36h`` / ``90m`` / ``2w`` before ``reference``, or an ISO 8601 time (no zone = UTC), to the minute."""
    text_value = (value or "").strip()
    match = DURATION.match(text_value)
    if match:
        if reference is None:
            raise ReportError(f"{option} {value!r}: a duration needs a reference time")
        minutes = float(match.group(1)) * UNITS_MIN[match.group(2).lower()]
        if minutes <= 0:
            raise ReportError(f"{option} {value!r}: the duration must be positive")
        return (reference - pd.Timedelta(minutes=minutes)).floor("min")
    try:
        moment = pd.Timestamp(text_value)
    except (ValueError, TypeError):
        moment = None
    if moment is None or pd.isna(moment) or not re.match(r"^\d{4}-\d{2}-\d{2}", text_value):
        raise ReportError(f"{option} {value!r}: expected a duration such as 7d, 36h, 90m, 2w or an ISO 8601 time "
                          "such as 2019-07-15T00:00")
    moment = moment.tz_localize("UTC") if moment.tzinfo is None else moment.tz_convert("UTC")
    return moment.floor("min")


@dataclass
class History:
    """Counts of the report's models on one minute axis, and what the replay needs besides.

    Attributes:
        ids: (N,) model ids, sorted.
        start: UTC time of column 0 (history before ``since`` when the store has it).
        counts: (N, T) counts per minute, unknown minutes replayed as 0.
        unknown: (N, T) True where the store has no coverage.
        since_col: column of ``since`` (the first scored minute); ``until`` is the end of the last column.
        models: the simulator's model table (index ``model_id``), from the catalogue.
        cold_cost: (N,) the plan job's cold cost per model (label ``cold_cost``, else ``planner_cold_cost``).
        fleet: the simulated cluster (nodes from the store's ``nodes``, else the simulator's default).
        notes: what the report states about its inputs (defaults filled in, unknown minutes, models left out).
    """

    ids: np.ndarray
    start: pd.Timestamp
    counts: np.ndarray
    unknown: np.ndarray
    since_col: int
    models: pd.DataFrame
    cold_cost: np.ndarray
    fleet: FleetConfig
    stored_from: datetime | None = None
    stored_until: datetime | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def since(self) -> pd.Timestamp:
        return self.start + self.since_col * MINUTE

    @property
    def until(self) -> pd.Timestamp:
        return self.start + self.counts.shape[1] * MINUTE


def _number(value) -> float | None:
    """A numeric label: a JSON number, or text holding one (``PUT /v1/models`` and ``prewarm models register
    --label`` store labels as text, as the plan job reads them: :func:`forecaster.store.fleet.read_fleet_inputs`);
    None when it is neither, or not finite."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value) \
        else None


def simulator_models(rows: list[tuple], default_cold_cost: float) -> tuple[pd.DataFrame, np.ndarray, list[str]]:
    """The catalogue rows (:data:`forecaster.store.history.CATALOGUE_COLUMNS`) as the simulator's model table.

    Missing sizes count as 0 bytes, missing GPUs as 1, a missing ``replica_rps`` as :data:`DEFAULT_REPLICA_RPS`
    (the fleet builder's default); ``request_s`` (which the store does not hold) is the label ``request_s``, else
    the simulator catalogue's value for the label ``catalog``, else :data:`DEFAULT_REQUEST_S`. Returns the table,
    the cold costs and one note per default used.
    """
    catalog = load_catalog()
    table, cold, defaulted = [], [], {"replica_rps": 0, "request_s": 0, "image": 0, "weights": 0}
    for model_id, image_ref, image_bytes, weights_uri, weights_bytes, gpus, rps, _slo, labels in rows:
        labels = labels or {}
        request_s = _number(labels.get("request_s"))
        if request_s is not None and not 0 < request_s <= MAX_REQUEST_S:
            request_s = None
        entry = labels.get("catalog")
        if request_s is None and isinstance(entry, str) and entry in catalog.index:
            request_s = float(catalog.at[entry, "request_s"])
        if request_s is None or request_s <= 0:
            request_s = DEFAULT_REQUEST_S
            defaulted["request_s"] += 1
        if rps is None or not rps > 0:
            rps = DEFAULT_REPLICA_RPS
            defaulted["replica_rps"] += 1
        defaulted["image"] += image_ref is None
        defaulted["weights"] += weights_uri is None
        table.append({"model_id": str(model_id), "image_ref": image_ref or "", "image_bytes": float(image_bytes or 0),
                      "weights_uri": weights_uri or "", "weights_bytes": float(weights_bytes or 0),
                      "gpus": float(max(1, gpus or 1)), "replica_rps": float(rps), "request_s": float(request_s)})
        label_cost = _number(labels.get("cold_cost"))
        # out of the planner's range (which the catalogue refuses now; the plan job skips such a stored model):
        # the default, as for no label
        usable = label_cost is not None and 0 <= label_cost <= MAX_COLD_COST
        cold.append(label_cost if usable else default_cold_cost)
    notes = []
    if defaulted["replica_rps"]:
        notes.append(f"{defaulted['replica_rps']} models have no replica_rps in the catalogue: "
                     f"{DEFAULT_REPLICA_RPS:g} request/s per replica assumed")
    if defaulted["request_s"]:
        notes.append(f"{defaulted['request_s']} models have no request duration (label request_s or catalog): "
                     f"{DEFAULT_REQUEST_S:g} s assumed for the reactive autoscaler's concurrency")
    if defaulted["image"] or defaulted["weights"]:
        notes.append(f"{defaulted['image']} models have no image and {defaulted['weights']} no weights in the "
                     "catalogue: their starts pull nothing")
    frame = pd.DataFrame(table).set_index("model_id") if table else pd.DataFrame()
    return frame, np.asarray(cold, dtype="float64"), notes


def fleet_config(rows: list[tuple], *, nodes: int | None = None, gpus_per_node: int | None = None) -> tuple[
        FleetConfig, str]:
    """The simulated cluster: ``nodes`` x ``gpus_per_node`` when given, else the store's registered nodes (their
    count, median GPUs, disk and host memory), else the simulator's default; and a line saying which."""
    default = FleetConfig()
    if nodes is not None or gpus_per_node is not None or not rows:
        config = FleetConfig(n_nodes=nodes or default.n_nodes, gpus_per_node=gpus_per_node or default.gpus_per_node)
        where = "as given" if (nodes or gpus_per_node) else "no nodes registered: the simulator's default"
        return config, f"{config.n_nodes} nodes x {config.gpus_per_node} GPUs ({where})"
    gpus = [int(r[1]) for r in rows if r[1]]
    disk = [float(r[2]) for r in rows if r[2]]
    host = [float(r[3]) for r in rows if r[3]]
    config = FleetConfig(n_nodes=len(rows), gpus_per_node=int(np.median(gpus)) if gpus else default.gpus_per_node,
                         disk_bytes=float(np.median(disk)) if disk else default.disk_bytes,
                         host_bytes=float(np.median(host)) if host else default.host_bytes)
    return config, f"{config.n_nodes} nodes x {config.gpus_per_node} GPUs (the store's registered nodes)"


def load_history(engine: Engine, *, since: str, until: str | None = None, models: list[str] | None = None,
                 history_min: int = 1440, default_cold_cost: float = 1.0, nodes: int | None = None,
                 gpus_per_node: int | None = None, now: datetime | None = None) -> History:
    """Read the window ``[since, until)`` and up to ``history_min`` minutes before it (see :class:`History`).

    ``until`` defaults to the end of the newest stored data of the models (or now, if that is earlier), so
    ``--since 7d`` on an imported 2019 trace means its last 7 days. ``since`` may be a duration before ``until``.
    """
    rows = read_catalogue(engine)
    catalogue_ids = [str(r[0]) for r in rows]
    if not catalogue_ids:
        raise ReportError("the catalogue is empty: register models (prewarm models register) or ingest a trace "
                          "with --register")
    if models:
        wanted = list(dict.fromkeys(m.strip() for m in models if m.strip()))
        unknown = sorted(set(wanted) - set(catalogue_ids))
        if unknown:
            shown = ", ".join(repr(m) for m in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5
                                                              else "")
            raise ReportError(f"--models: {shown} not in the catalogue ({len(catalogue_ids)} models; "
                              "prewarm models list)")
        rows = [r for r in rows if str(r[0]) in set(wanted)]
    ids = [str(r[0]) for r in rows]
    first, last = stored_span(engine, ids)
    if last is None:
        raise ReportError(f"no invocations stored for the {len(ids)} models asked for")
    now_ts = pd.Timestamp(now or datetime.now(timezone.utc)).tz_convert("UTC")
    first_ts, last_ts = pd.Timestamp(first).tz_convert("UTC"), pd.Timestamp(last).tz_convert("UTC")
    end = parse_moment(until, option="--until", reference=now_ts) if until else min(last_ts, now_ts).floor("min")
    begin = parse_moment(since, option="--since", reference=end)
    if begin >= end:
        raise ReportError(f"--since {since!r} ({begin:%Y-%m-%d %H:%M}) is not before --until ({end:%Y-%m-%d %H:%M})")
    held = f"the store holds {first_ts:%Y-%m-%d %H:%M} .. {last_ts:%Y-%m-%d %H:%M} UTC"
    if end <= first_ts or begin >= last_ts:
        raise ReportError(f"no data between {begin:%Y-%m-%d %H:%M} and {end:%Y-%m-%d %H:%M} UTC ({held})")
    start = max(begin - pd.Timedelta(minutes=history_min), first_ts.ceil("min"))
    start = min(start, begin)
    grid_ids, _, grid = read_grid(engine, ids, start.to_pydatetime(), end.to_pydatetime())
    since_col = int((begin - start) // MINUTE)
    unknown = np.isnan(grid)
    window_known = ~unknown[:, since_col:]
    if not window_known.any():
        raise ReportError(f"no data between {begin:%Y-%m-%d %H:%M} and {end:%Y-%m-%d %H:%M} UTC ({held})")
    notes = []
    empty = ~window_known.any(axis=1)
    if empty.any():
        left_out = [grid_ids[i] for i in np.flatnonzero(empty)]
        notes.append(f"{len(left_out)} models have no data in the window and are left out: "
                     + ", ".join(left_out[:5]) + (" ..." if len(left_out) > 5 else ""))
    keep = ~empty
    # the history starts where any kept model has data
    known_cols = np.flatnonzero((~unknown[keep]).any(axis=0))
    lead = int(min(known_cols[0], since_col)) if len(known_cols) else since_col
    grid, unknown = grid[keep][:, lead:], unknown[keep][:, lead:]
    since_col -= lead
    start = start + lead * MINUTE
    kept_ids = np.asarray([m for m, k in zip(grid_ids, keep) if k], dtype=object)
    unknown_window = int(unknown[:, since_col:].sum())
    if unknown_window:
        notes.append(f"{unknown_window:,} model-minutes of the window are not covered by any ingest and are "
                     "replayed as zero")
    by_id = {str(r[0]): r for r in rows}
    table, cold, model_notes = simulator_models([by_id[m] for m in kept_ids], default_cold_cost)
    config, fleet_note = fleet_config(node_shapes(engine), nodes=nodes, gpus_per_node=gpus_per_node)
    return History(ids=kept_ids, start=start, counts=np.nan_to_num(grid, nan=0.0), unknown=unknown,
                   since_col=since_col, models=table, cold_cost=cold, fleet=config,
                   stored_from=first_ts.to_pydatetime(), stored_until=last_ts.to_pydatetime(),
                   notes=[fleet_note, *model_notes, *notes])
