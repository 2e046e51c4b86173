"""The simulated fleet: nodes, caches, bandwidths and cold-start phase defaults, with their sources.

Defaults describe an 8-GPU node class and a shared registry and object store.
Where a value comes from a measurement, the source is named; the rest are
stated assumptions (all of them settable).

Phases of one cold start, in order (each only when needed):

1. image pull: ``image_bytes`` at ``min(image_pull_bytes_per_s, node NIC share,
   registry share)``. Pulls are bound by layer download plus decompression
   rather than the NIC; vLLM's PR #22377 halves pull time by splitting layers
   so that they pull in parallel. 200 MB/s per pull is an assumption in line
   with a 10-15 GB image taking about a minute.
2. weight fetch: ``weights_bytes`` from S3 at ``min(weight_fetch_bytes_per_s,
   node NIC share, bucket share)``. 600 MB/s per node is what the issue's
   example implies (vLLM + Llama-2-7B on an A10: 44.7 s in total, over half of
   it fetching 13.5 GB).
3. weight load into GPU memory: from local disk at ``disk_read_bytes_per_s``
   (2 GB/s, one NVMe), from host memory at ``host_to_gpu_bytes_per_s``
   (12 GB/s, about half of PCIe 4.0 x16).
4. runtime start: Python and framework imports 2.7 s and CUDA context 1.6 s
   (the issue's figures), plus ``engine_warmup_s`` (memory profiling, CUDA graph
   capture; 6 s is an assumption).
5. registration: readiness probe and endpoint propagation, 2 s (assumption).

Each fixed phase is multiplied by log-normal noise (``phase_noise_sigma``);
shared registries are ``peak_slowdown`` times slower in ``peak_hours_utc``
(assumed diurnal load), so that hour of day and contention both matter.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1_000_000_000


@dataclass(frozen=True)
class FleetConfig:
    """Simulated fleet and timing defaults (bytes, seconds, bytes per second)."""

    n_nodes: int = 32
    gpus_per_node: int = 8
    disk_bytes: float = 4_000 * GB
    host_bytes: float = 1_000 * GB

    node_nic_bytes_per_s: float = 3.125 * GB  # 25 Gbit/s
    image_pull_bytes_per_s: float = 0.2 * GB
    registry_bytes_per_s: float = 10 * GB  # per registry host
    weight_fetch_bytes_per_s: float = 0.6 * GB
    bucket_bytes_per_s: float = 25 * GB  # per object-store bucket
    disk_read_bytes_per_s: float = 2 * GB
    host_to_gpu_bytes_per_s: float = 12 * GB

    python_import_s: float = 2.7
    cuda_context_s: float = 1.6
    engine_warmup_s: float = 6.0
    registration_s: float = 2.0
    phase_noise_sigma: float = 0.1
    peak_hours_utc: tuple[int, int] = (13, 21)
    peak_slowdown: float = 1.25

    keep_weights_after_release: bool = False  # a pod's downloaded weights go with the pod unless pre-loaded
    wait_slo_s: float = 5.0
    tick_s: float = 1.0
    score_from_s: float = 0.0  # requests and GPU-seconds before this are warm-up, not scored
    seed: int = 0

    @property
    def runtime_init_s(self) -> float:
        return self.python_import_s + self.cuda_context_s + self.engine_warmup_s
