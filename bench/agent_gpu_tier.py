"""The node agent's GPU tier on a real GPU: load speed, the bytes on the device, and the memory given back.

``preload(uri, tier="gpu")`` copies cached weights into GPU memory through a pinned staging buffer
(``NodeAgent._load_gpu``); ``evict(uri, tier="gpu")`` drops them; the agent's ``state()`` reports each GPU's free
memory from ``nvidia-smi``, which the planner reads as the node's room. This script writes ``--size-mib`` of random
bytes into a fresh weights cache (the cache's own reserve / staging / commit steps, as a finished S3 download
leaves them; no S3 server is involved), then:

1. pre-loads them into GPU memory (the first load also creates the process's CUDA context);
2. reads the GPU copy back and compares its SHA-256 with the file's;
3. reads free GPU memory with ``nvidia-smi`` before the load, after it and after the eviction: what the node
   reports to the planner, and whether the eviction gives the memory back to other processes;
4. times ``--repeats`` more loads (each evicted again) against the tier's first loop, measured in the same run
   (:func:`sync_copy_s`: one pinned buffer, read then copy, never overlapping), from the page cache.

Without a GPU the pre-load must fail with reason ``no_gpu`` and the weights stay on disk; that is printed too.

    python bench/agent_gpu_tier.py [--size-mib 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from forecaster.agent.cache import WeightsCache  # noqa: E402
from forecaster.agent.service import NodeAgent, gpus  # noqa: E402

URI = "s3://weights/bench/gpu-tier.bin"
BLOCK = 64 << 20


def cached_weights(cache: WeightsCache, size: int) -> str:
    """Random ``size`` bytes committed to ``cache`` under :data:`URI`; returns their SHA-256."""
    cache.reserve(URI, size)
    staging = cache.staging_dir(URI)
    digest = hashlib.sha256()
    with open(staging / "data", "wb") as handle:
        left = size
        while left:
            block = os.urandom(min(BLOCK, left))
            digest.update(block)
            handle.write(block)
            left -= len(block)
    sha = digest.hexdigest()
    cache.commit(staging, uri=URI, size=size, sha256=sha, fetched_at=datetime.now(timezone.utc).isoformat())
    cache.release(URI)
    return sha


def free_mib() -> list[int]:
    """Free memory per GPU (MiB) as ``nvidia-smi`` reports it, through the agent's own reader."""
    return [g["memory_free_bytes"] >> 20 for g in gpus()]


def sync_copy_s(path: Path, size: int, index: int = 0) -> float:
    """Seconds for the GPU tier's first loop (before 2026-12-04), the baseline: one pinned 64 MiB buffer, each chunk
    read and then copied synchronously, so reading and copying never overlap."""
    import torch

    started = time.perf_counter()
    tensor = torch.empty(size, dtype=torch.uint8, device=f"cuda:{index}")
    staging = torch.empty(min(BLOCK, size), dtype=torch.uint8, pin_memory=True)
    view = memoryview(staging.numpy())
    with open(path, "rb", buffering=0) as handle:
        pos = 0
        while pos < size:
            n = handle.readinto(view[: min(len(view), size - pos)])
            tensor[pos:pos + n].copy_(staging[:n])
            pos += n
    torch.cuda.synchronize(index)
    seconds = time.perf_counter() - started
    del tensor
    torch.cuda.empty_cache()
    return seconds


def run(size_mib: int, repeats: int = 3) -> dict:
    size = size_mib << 20
    with tempfile.TemporaryDirectory(prefix="pw-gpu-tier-") as tmp:
        cache = WeightsCache(Path(tmp) / "cache", reserve_bytes=0)
        sha = cached_weights(cache, size)
        agent = NodeAgent(node_name="bench", cache=cache, cri=None, s3=None)
        report: dict = {"size_mib": size_mib, "gpus": [{k: g[k] for k in ("index", "name")} for g in gpus()],
                        "free_mib_before": free_mib()}
        try:
            started = time.perf_counter()
            result = agent.preload(URI, tier="gpu", deadline_s=600)
            wall_s = time.perf_counter() - started
            report["first_preload"] = {"status": result.status, "reason": result.reason, "message": result.message,
                                       "wall_s": wall_s, "timings": result.timings,
                                       "gpu_device": result.detail.get("gpu_device"),
                                       "note": "includes creating the process's CUDA context"}
            if result.status == "succeeded":
                report["free_mib_after_load"] = free_mib()
                tensor = agent._gpu[cache.get(URI).key][0]
                report["sha256_matches"] = hashlib.sha256(tensor.cpu().numpy().tobytes()).hexdigest() == sha
                del tensor
                report["state_tiers"] = agent.state()["weights"][0]["tiers"]
                report["evicted_tiers"] = agent.evict(URI, tier="gpu")["evicted_tiers"]
                report["free_mib_after_evict"] = free_mib()
                loads = []
                for _ in range(repeats):  # the CUDA context exists now: the load alone
                    again = agent.preload(URI, tier="gpu", deadline_s=600)
                    loads.append(again.timings["weight_load_s"])
                    agent.evict(URI, tier="gpu")
                baseline = [sync_copy_s(cache.get(URI).path, size) for _ in range(repeats)]
                load_s, base_s = statistics.median(loads), statistics.median(baseline)
                report["warm_load"] = {"median_s": load_s, "gb_per_s": size / 1e9 / load_s, "runs_s": loads}
                report["baseline_sync_copy"] = {"median_s": base_s, "gb_per_s": size / 1e9 / base_s,
                                                "runs_s": baseline}
                report["speedup_over_baseline"] = base_s / load_s
                report["free_mib_at_end"] = free_mib()
            report["still_on_disk"] = cache.get(URI) is not None
        finally:
            agent.close()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="Size of the weights file (MiB).")
    parser.add_argument("--repeats", type=int, default=3, help="Warm loads and baseline copies (median reported).")
    parser.add_argument("--json", type=Path, default=None, help="Write the figures as JSON here.")
    args = parser.parse_args()
    report = run(args.size_mib, args.repeats)
    print(json.dumps(report, indent=1, default=str))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
