"""Phases of a cold start and the cache states a replica can start from.

Shared by ingest (validation of observed events), the store, the latency
model, the planner and the simulator.
"""

from __future__ import annotations

#: Per-phase seconds of one cold start, in order (each only when needed).
PHASES = ("image_pull_s", "weight_fetch_s", "weight_load_s", "runtime_init_s", "registration_s")

#: Where a node held the model's artefacts when a replica started (as reported by observers).
CACHE_STATES = ("none", "image", "disk", "host", "gpu", "sleeping")

#: Cache states a replica can start from, coldest first (what the planner and the latency model use).
START_STATES = ("none", "image", "disk", "host")
STATE_RANK = {s: i for i, s in enumerate(START_STATES)}
