"""Node state reports: free capacity and what each node holds, as a node agent (or a simulated cluster) reports it.

The plan job reads ``nodes`` and ``node_cache`` (see :mod:`forecaster.store.fleet`); a report replaces, for
each reported node, its capacity row and its cache rows in one transaction, so the store holds the last
report and nothing stale from before it.
"""

from __future__ import annotations

from datetime import datetime

import pandas as pd
from sqlalchemy import Connection, text


def report_node_state(conn: Connection, *, nodes: pd.DataFrame, artefacts: pd.DataFrame, gpus_total: int,
                      now: datetime) -> dict:
    """Upsert each node of ``nodes`` and replace its ``node_cache`` rows with ``artefacts``.

    Args:
        conn: an open connection inside a transaction.
        nodes: indexed by ``node_id``: ``gpus_free`` (GPUs, rounded down), ``host_free_bytes``,
            ``disk_free_bytes`` (bytes).
        artefacts: ``node_id, kind (image | weights), ref (image reference or weights URI), tier
            (image | disk | host | gpu)``.
        gpus_total: GPUs per node.
        now: the report's time (``updated_at``).

    Returns:
        ``{"nodes": n, "cache_rows": m}``.
    """
    node_rows = [{"id": str(node), "total": int(gpus_total), "free": int(max(0.0, row.gpus_free) // 1),
                  "disk": int(max(0.0, row.disk_free_bytes)), "host": int(max(0.0, row.host_free_bytes)), "now": now}
                 for node, row in nodes.iterrows()]
    if not node_rows:
        return {"nodes": 0, "cache_rows": 0}
    conn.execute(text(
        "INSERT INTO nodes (id, gpus_total, gpus_free, disk_free_bytes, host_memory_free_bytes, updated_at) "
        "VALUES (:id, :total, :free, :disk, :host, :now) ON CONFLICT (id) DO UPDATE SET "
        "gpus_total = EXCLUDED.gpus_total, gpus_free = EXCLUDED.gpus_free, disk_free_bytes = EXCLUDED.disk_free_bytes, "
        "host_memory_free_bytes = EXCLUDED.host_memory_free_bytes, updated_at = EXCLUDED.updated_at"), node_rows)
    conn.execute(text("DELETE FROM node_cache WHERE node_id = ANY(:ids)"), {"ids": [r["id"] for r in node_rows]})
    cache_rows = [{"node": str(a.node_id), "kind": str(a.kind), "ref": str(a.ref), "tier": str(a.tier), "now": now}
                  for a in artefacts.drop_duplicates(["node_id", "kind", "ref", "tier"]).itertuples(index=False)]
    if cache_rows:
        conn.execute(text("INSERT INTO node_cache (node_id, artefact_kind, ref, tier, updated_at) "
                          "VALUES (:node, :kind, :ref, :tier, :now)"), cache_rows)
    return {"nodes": len(node_rows), "cache_rows": len(cache_rows)}


def register_nodes(conn: Connection, *, count: int, gpus_per_node: int, disk_bytes: int, host_bytes: int,
                   prefix: str = "node-") -> None:
    """Add ``count`` nodes ``<prefix>0..`` with all GPUs free (existing ids are left as they are)."""
    for i in range(count):
        conn.execute(text(
            "INSERT INTO nodes (id, gpus_total, gpus_free, disk_free_bytes, host_memory_free_bytes) "
            "VALUES (:id, :g, :g, :d, :h) ON CONFLICT (id) DO NOTHING"),
            {"id": f"{prefix}{i}", "g": gpus_per_node, "d": disk_bytes, "h": host_bytes})
