"""Pre-load and pre-pull benchmark against real local parts.

Pre-load: a seaweedfs S3 server on loopback holds one object (``--size-mb``, default 512 MiB, random bytes,
sha256 in its metadata). In the same run it is read

* plainly: one ``get_object`` stream written to a file (boto3, 1 MiB reads), and
* by the node agent (``prewarm agent``, a separate process): ``POST /v1/preload`` = parallel ranged reads,
  in-order sha256, fsync, atomic rename, measured from request to answer.

Each is run ``--rounds`` times alternately (the cache entry evicted in between) and the best of each is kept.
The agent's peak RSS is its ``VmHWM`` after all rounds. Target: preload_mb_s >= plain_mb_s with the agent
under 256 MB.

Pre-pull (needs root, ``docker-registry``, ``skopeo``, ``containerd``, ``ctr``): an image with a
``--image-mb`` layer is pushed to a local registry; the agent pre-pulls it through CRI ``PullImage`` into a
containerd of its own, then the image is removed and pulled again with ``ctr images pull``; best of rounds.

    python bench/preload.py [--size-mb 512] [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.runtime_fixtures import (  # noqa: E402
    build_oci_archive,
    free_port,
    push_image,
    start_containerd,
    start_registry,
    start_seaweedfs,
    stop_process,
    wait_until,
)

TOKEN = "bench-token"


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _upload(s3, size: int, workdir: Path) -> tuple[str, str]:
    client = s3.client()
    client.create_bucket(Bucket="bench")
    path = workdir / "object.bin"
    digest = hashlib.sha256()
    with open(path, "wb") as handle:
        left = size
        while left:
            block = os.urandom(min(left, 16 << 20))
            digest.update(block)
            handle.write(block)
            left -= len(block)
    client.upload_file(str(path), "bench", "model/weights.bin", ExtraArgs={"Metadata": {"sha256": digest.hexdigest()}})
    path.unlink()
    return "s3://bench/model/weights.bin", digest.hexdigest()


def _plain_download(s3, target: Path, *, verify: bool = False) -> float:
    """One GET stream to a file (fsync'd); with ``verify``, sha256 computed on the way (what trusting it costs)."""
    client = s3.client()
    digest = hashlib.sha256() if verify else None
    t0 = time.perf_counter()
    body = client.get_object(Bucket="bench", Key="model/weights.bin")["Body"]
    with open(target, "wb") as handle:
        while chunk := body.read(1 << 20):
            handle.write(chunk)
            if digest is not None:
                digest.update(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    elapsed = time.perf_counter() - t0
    target.unlink()
    return elapsed


def _forget_image(containerd, ref: str) -> None:
    """Remove the image and every blob, so the next pull fetches everything again."""
    containerd.ctr("images", "rm", "--sync", ref)
    digests = containerd.ctr("content", "ls", "-q").stdout.split()
    if digests:
        containerd.ctr("content", "rm", *digests)


def _start_agent(workdir: Path, s3, socket: Path | None, port: int) -> subprocess.Popen:
    env = {**os.environ, "PREWARM_AGENT_TOKEN": TOKEN, "PREWARM_AGENT_NODE_NAME": "bench-node",
           "PREWARM_AGENT_CACHE_DIR": str(workdir / "cache"), "PREWARM_AGENT_S3_ENDPOINT_URL": s3.endpoint_url,
           "PREWARM_AGENT_S3_ACCESS_KEY_ID": s3.access_key, "PREWARM_AGENT_S3_SECRET_ACCESS_KEY": s3.secret_key,
           "PREWARM_AGENT_DISK_RESERVE_BYTES": "0", "PREWARM_DATA_DIR": str(workdir / "data"),
           "PREWARM_AGENT_CONTAINERD_SOCKET": str(socket or workdir / "none.sock")}
    log = open(workdir / "agent.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "forecaster.cli", "agent", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200, timeout=60,
               what="agent", proc=proc, log=workdir / "agent.log")
    return proc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=512, help="weights object size, MiB")
    parser.add_argument("--image-mb", type=int, default=64, help="test image layer size, MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args()
    size = args.size_mb << 20
    figures: dict = {"size_mb": args.size_mb, "image_mb": args.image_mb, "cpus": os.cpu_count(),
                     "loadavg_start": os.getloadavg()[0]}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="pw-bench-", dir="/tmp") as tmp:
        workdir = Path(tmp)
        try:
            s3 = start_seaweedfs(workdir / "s3")
            procs.append(s3.process)
            uri, sha = _upload(s3, size, workdir)
            can_pull = os.geteuid() == 0 and all(
                subprocess.run(["which", b], capture_output=True).returncode == 0
                for b in ("docker-registry", "skopeo", "containerd", "ctr"))
            containerd = registry = None
            if can_pull:
                registry = start_registry(workdir / "registry")
                procs.append(registry.process)
                containerd = start_containerd(workdir / "ctd", mirrors={registry.host: registry.host})
                procs.append(containerd.process)
            port = free_port()
            agent = _start_agent(workdir, s3, containerd.socket if containerd else None, port)
            procs.append(agent)
            base = f"http://127.0.0.1:{port}"
            headers = {"Authorization": f"Bearer {TOKEN}"}
            http = httpx.Client(headers=headers, timeout=600)
            _plain_download(s3, workdir / "warmup.bin")  # server-side caches warm for both
            plain, plain_verified, preload = [], [], []
            for _ in range(args.rounds):
                plain.append(_plain_download(s3, workdir / "plain.bin"))
                plain_verified.append(_plain_download(s3, workdir / "plain.bin", verify=True))
                t0 = time.perf_counter()
                answer = http.post(f"{base}/v1/preload", json={"weights_uri": uri, "tier": "disk",
                                                               "deadline_s": 600})
                preload.append(time.perf_counter() - t0)
                body = answer.json()
                if answer.status_code != 200 or body["detail"]["sha256"] != sha:
                    raise RuntimeError(f"preload failed: {body}")
                http.delete(f"{base}/v1/weights", params={"uri": uri})
            figures["plain_mb_s"] = round(size / 1e6 / min(plain), 1)
            figures["preload_mb_s"] = round(size / 1e6 / min(preload), 1)
            figures["ratio"] = round(figures["preload_mb_s"] / figures["plain_mb_s"], 3)
            figures["plain_sha256_mb_s"] = round(size / 1e6 / min(plain_verified), 1)
            figures["plain_s_rounds"] = [round(x, 3) for x in plain]
            figures["preload_s_rounds"] = [round(x, 3) for x in preload]
            figures["agent_peak_rss_mb"] = round(_peak_rss_mb(agent.pid), 1)
            figures["prepull_s"] = figures["ctr_pull_s"] = None
            if can_pull:
                archive = build_oci_archive(workdir / "image.tar", tag="v1", payload_bytes=args.image_mb << 20)
                ref = push_image(archive, "v1", registry, name="bench/server")
                prepull, ctr = [], []
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    answer = http.post(f"{base}/v1/prepull", json={"image": ref, "deadline_s": 300})
                    prepull.append(time.perf_counter() - t0)
                    if answer.status_code != 200 or answer.json()["already_present"]:
                        raise RuntimeError(f"prepull failed: {answer.text}")
                    _forget_image(containerd, ref)
                    t0 = time.perf_counter()
                    out = containerd.ctr("images", "pull", "--plain-http", ref)
                    ctr.append(time.perf_counter() - t0)
                    if out.returncode != 0:
                        raise RuntimeError(f"ctr pull failed: {out.stderr}")
                    _forget_image(containerd, ref)
                figures["prepull_s"] = round(min(prepull), 3)
                figures["ctr_pull_s"] = round(min(ctr), 3)
                figures["prepull_s_rounds"] = [round(x, 3) for x in prepull]
                figures["ctr_pull_s_rounds"] = [round(x, 3) for x in ctr]
            http.close()
        finally:
            for proc in reversed(procs):
                stop_process(proc, timeout=15)
            subprocess.run(["umount", "-R", str(workdir)], capture_output=True)
    figures["loadavg_end"] = os.getloadavg()[0]
    print(f"pre-load {args.size_mb} MiB from local S3: agent {figures['preload_mb_s']} MB/s, plain single stream "
          f"{figures['plain_mb_s']} MB/s, ratio {figures['ratio']} (plain + sha256: {figures['plain_sha256_mb_s']} MB/s); "
          f"agent peak RSS {figures['agent_peak_rss_mb']} MB")
    if figures["prepull_s"] is not None:
        print(f"pre-pull of a {args.image_mb} MiB image: agent (CRI PullImage) {figures['prepull_s']} s, "
              f"ctr images pull {figures['ctr_pull_s']} s")
    else:
        print("pre-pull not measured (needs root, docker-registry, skopeo, containerd, ctr)")
    print(f"load average {figures['loadavg_start']:.2f} -> {figures['loadavg_end']:.2f} on {figures['cpus']} CPUs")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
