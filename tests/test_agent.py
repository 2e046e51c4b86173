"""The node agent end to end with real parts started here: registry + skopeo-pushed images + containerd (CRI),
and a seaweedfs S3 server holding a 256 MiB weights file.

Tests that need containerd need root; they are skipped only where root or the binaries are truly absent, and
fail instead under ``CI``.
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pandas as pd
import pytest
from sqlalchemy import text

from forecaster.actuation.actuator import Actuator
from forecaster.actuation.backends.agent import AgentBackend
from forecaster.store.actions import list_actions
from forecaster.agent.cache import WeightsCache
from forecaster.agent.cri import CriImageService
from forecaster.agent.service import NodeAgent
from forecaster.agent.errors import AgentError
from forecaster.agent.weights import PART_RESUMES, S3WeightsSource
from forecaster.coldstart.service import load_latency_model, train_latency_model
from forecaster.contracts.actions import Action, ActionKind, ActionStatus, FailureReason, Plan, Reason, Tier
from tests import runtime_fixtures
from tests.runtime_fixtures import S3Server, free_port, start_agent_process, stop_process, wait_until

# Session fixtures: real registry, images, containerd and S3 (see tests/runtime_fixtures.py).
registry = runtime_fixtures.registry
auth_registry = runtime_fixtures.auth_registry
test_images = runtime_fixtures.test_images
containerd = runtime_fixtures.containerd
s3_server = runtime_fixtures.s3_server

BIG_BYTES = 256 << 20  # "a weights file of a few hundred MB"
TOKEN = "agent-test-token-7f3a"


@pytest.fixture(scope="session")
def weights(s3_server: S3Server, tmp_path_factory) -> dict:
    """Objects in bucket ``weights``: ``big.bin`` (256 MiB, sha256 in metadata), ``small-{a,b,c}.bin`` (4 MiB,
    single-part: MD5 ETag), ``liar.bin`` (metadata names a wrong sha256)."""
    client = s3_server.client()
    client.create_bucket(Bucket="weights")
    path = tmp_path_factory.mktemp("weights") / "big.bin"
    digest = hashlib.sha256()
    with open(path, "wb") as handle:
        for _ in range(BIG_BYTES // (16 << 20)):
            block = os.urandom(16 << 20)
            digest.update(block)
            handle.write(block)
    sha = digest.hexdigest()
    client.upload_file(str(path), "weights", "llama/big.bin", ExtraArgs={"Metadata": {"sha256": sha}})
    path.unlink()
    small = {}
    for name in ("a", "b", "c"):
        body = os.urandom(4 << 20)
        client.put_object(Bucket="weights", Key=f"small-{name}.bin", Body=body)
        small[name] = hashlib.sha256(body).hexdigest()
    client.put_object(Bucket="weights", Key="liar.bin", Body=b"not what it says" * 1000,
                      Metadata={"sha256": "0" * 64})
    return {"big": "s3://weights/llama/big.bin", "big_sha256": sha, "small": small}


def _source(s3: S3Server, **kw) -> S3WeightsSource:
    return S3WeightsSource(endpoint_url=s3.endpoint_url, access_key_id=kw.pop("key", s3.access_key),
                           secret_access_key=kw.pop("secret", s3.secret_key), **kw)


def _agent(tmp_path: Path, s3: S3Server | None, socket: Path | None = None, **kw) -> NodeAgent:
    cache = WeightsCache(tmp_path / "cache", max_bytes=kw.pop("max_bytes", None), reserve_bytes=0)
    return NodeAgent(node_name="node-a", cache=cache, cri=None if socket is None else CriImageService(socket),
                     s3=None if s3 is None else _source(s3), **kw)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


# --- pre-pull through CRI ------------------------------------------------------------------------------------------


def test_prepull_puts_the_image_where_kubelet_looks_and_a_second_is_a_no_op(tmp_path, containerd, test_images):
    agent = _agent(tmp_path, None, containerd.socket)
    image = test_images["small"]
    try:
        result = agent.prepull(image, deadline_s=60, model_id="m")
        assert result.status == "succeeded" and not result.already_present
        assert result.timings["image_pull_s"] > 0 and result.size_bytes > 2 << 20
        # A separate CRI client (as kubelet would) finds it, in containerd's k8s.io namespace.
        status = CriImageService(containerd.socket).image_status(image)
        assert status is not None and image in status.repo_tags
        assert image in containerd.ctr("images", "ls", "-q").stdout.split()
        again = agent.prepull(image, deadline_s=60)
        assert again.status == "succeeded" and again.already_present and again.timings == {}
        assert [o["kind"] for o in agent.observations()] == ["prepull"]  # only the real pull is an observation
        assert any(i["ref"] == image for i in agent.state()["images"])
    finally:
        agent.close()


def test_concurrent_prepulls_of_one_image_are_one_pull(tmp_path, containerd, test_images):
    agent = _agent(tmp_path, None, containerd.socket)
    image = test_images["other"]
    containerd.ctr("images", "rm", image)
    results = []
    threads = [threading.Thread(target=lambda: results.append(agent.prepull(image, deadline_s=60)))
               for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status for r in results] == ["succeeded"] * 4
        assert sum(not r.deduplicated and not r.already_present for r in results) == 1
        assert len([o for o in agent.observations() if o["ref"] == image]) == 1
    finally:
        agent.close()


def test_prepull_from_a_private_registry_uses_the_secret_file(tmp_path, containerd, test_images, auth_registry):
    image = test_images["private"]
    secret = tmp_path / "config.json"
    agent = _agent(tmp_path, None, containerd.socket, registry_auth_file=secret)
    try:
        secret.write_text(json.dumps({"auths": {auth_registry.host: {
            "auth": base64.b64encode(b"puller:wrong-password").decode()}}}))
        wrong = agent.prepull(image, deadline_s=60)
        assert wrong.status == "failed" and wrong.reason == "unauthorised" and not wrong.temporary
        secret.write_text(json.dumps({"auths": {auth_registry.host: {"username": "puller",
                                                                     "password": "s3cret-pull"}}}))
        right = agent.prepull(image, deadline_s=60)  # the file is read again: a rotated secret applies
        assert right.status == "succeeded", right.message
        # A registry containerd reaches through a mirror (as docker.io through registry-1.docker.io): the
        # credentials are the image's registry's, and containerd must not drop them for naming another host.
        mirrored = image.replace(auth_registry.host, runtime_fixtures.MIRRORED_REGISTRY, 1)
        secret.write_text(json.dumps({"auths": {runtime_fixtures.MIRRORED_REGISTRY: {
            "username": "puller", "password": "s3cret-pull"}}}))
        through_mirror = agent.prepull(mirrored, deadline_s=60)
        assert through_mirror.status == "succeeded", through_mirror.message
    finally:
        agent.close()


def test_prepull_failures_have_fixed_reasons(tmp_path, containerd, registry):
    agent = _agent(tmp_path, None, containerd.socket)
    down = _agent(tmp_path / "down", None, tmp_path / "no-such.sock")
    try:
        missing = agent.prepull(f"{registry.host}/prewarm/absent:v9", deadline_s=60)
        assert (missing.status, missing.reason, missing.temporary) == ("failed", "not_found", False)
        no_runtime = down.prepull(f"{registry.host}/prewarm/small:v1", deadline_s=5)
        assert (no_runtime.reason, no_runtime.temporary) == ("runtime_unavailable", True)
        assert down.state()["images_error"]["reason"] == "runtime_unavailable"
    finally:
        agent.close()
        down.close()


# --- pre-load from S3 ----------------------------------------------------------------------------------------------


def test_preload_a_few_hundred_mb_checksum_matches_and_a_second_is_a_no_op(tmp_path, s3_server, weights):
    agent = _agent(tmp_path, s3_server)
    try:
        result = agent.preload(weights["big"], tier=Tier.DISK, deadline_s=120, model_id="llama")
        assert result.status == "succeeded", result.message
        assert result.size_bytes == BIG_BYTES and result.detail["verified_by"] == "sha256"
        entry = agent.cache.get(weights["big"])
        assert _sha256_file(entry.path) == weights["big_sha256"] == result.detail["sha256"]
        again = agent.preload(weights["big"], tier=Tier.DISK, deadline_s=120)
        assert again.status == "succeeded" and again.already_present and again.timings == {}
        assert len(agent.observations()) == 1
        # Host tier: no new fetch, the file is locked in memory (root may mlock) and counted.
        host = agent.preload(weights["big"], tier=Tier.HOST, deadline_s=120)
        assert host.status == "succeeded" and "weight_fetch_s" not in host.timings
        assert host.detail["host_residency"] == "pinned"
        state = agent.state()
        [row] = state["weights"]
        assert row["tiers"] == ["disk", "host"] and state["memory"]["host_resident_bytes"] == BIG_BYTES
        assert agent.evict(weights["big"], tier=Tier.HOST)["evicted_tiers"] == ["host"]
        assert agent.state()["memory"]["host_resident_bytes"] == 0
    finally:
        agent.close()


def test_gpu_tier_loads_into_gpu_memory_or_says_clearly_that_it_cannot(tmp_path, s3_server, weights):
    import torch

    agent = _agent(tmp_path, s3_server)
    try:
        result = agent.preload("s3://weights/small-a.bin", tier=Tier.GPU, deadline_s=60)
        if torch.cuda.is_available():
            assert result.status == "succeeded" and result.detail["gpu_device"].startswith("cuda:")
            assert agent.state()["weights"][0]["tiers"] == ["disk", "gpu"]
        else:
            assert (result.status, result.reason, result.temporary) == ("failed", "no_gpu", False)
            assert "no usable GPU" in result.message
        assert agent.cache.get("s3://weights/small-a.bin") is not None  # on disk either way
    finally:
        agent.close()


def test_dropping_gpu_tier_weights_hands_the_memory_back(tmp_path, monkeypatch):
    """PyTorch keeps freed GPU blocks for its own reuse, so an evicted GPU-tier copy would still read as used in
    nvidia-smi (the node's free memory for the planner, and for a replica starting there): dropping one asks
    torch to hand it back, on evict and on close. (On a GPU, ``bench/agent_gpu_tier.py`` measures that the
    memory comes back: docs/scale.md.)"""
    from forecaster.agent import service

    calls = []
    monkeypatch.setattr(service, "_return_gpu_memory", lambda: calls.append(1))
    agent = _agent(tmp_path, None)
    key = "s3://weights/x.bin"
    try:
        assert agent.evict(key, tier="gpu")["evicted_tiers"] == [] and calls == []  # nothing held: nothing asked
        agent._gpu[service.entry_key(key)] = (object(), "cuda:0", 1)
        assert agent.evict(key, tier="host")["evicted_tiers"] == [] and calls == []
        assert agent.evict(key, tier="gpu")["evicted_tiers"] == ["gpu"] and calls == [1]
        agent._gpu[service.entry_key(key)] = (object(), "cuda:0", 1)
    finally:
        agent.close()
    assert calls == [1, 1] and agent._gpu == {}


def test_preload_failures_have_fixed_reasons_and_leave_nothing_cached(tmp_path, s3_server, weights):
    agent = _agent(tmp_path, s3_server)
    wrong = NodeAgent(node_name="node-a", cache=WeightsCache(tmp_path / "c2"), cri=None,
                      s3=_source(s3_server, secret="not-the-secret"))
    try:
        cases = {
            "unauthorised": wrong.preload(weights["big"], deadline_s=30),
            "not_found": agent.preload("s3://weights/absent.bin", deadline_s=30),
            "checksum_mismatch": agent.preload("s3://weights/liar.bin", deadline_s=30),
            "timeout": agent.preload(weights["big"], deadline_s=0.2),
        }
        for reason, result in cases.items():
            assert (result.status, result.reason) == ("failed", reason), result.message
        assert cases["timeout"].temporary and not cases["unauthorised"].temporary
        # The timed-out transfer stops at its own deadline check moments after the caller got its answer.
        wait_until(lambda: not agent.state()["in_flight"], timeout=10, what="transfer stop")
        assert agent.state()["weights"] == [] and wrong.state()["weights"] == []
        assert list((tmp_path / "cache" / "tmp").iterdir()) == []  # staging removed
        # A sha256 the request names is checked too.
        named = agent.preload("s3://weights/small-a.bin", sha256="ab" * 32, deadline_s=30)
        assert named.reason == "checksum_mismatch"
        ok = agent.preload("s3://weights/small-a.bin", sha256=weights["small"]["a"], deadline_s=30)
        assert ok.status == "succeeded" and ok.detail["verified_by"] == "sha256"
        etag = agent.preload("s3://weights/small-b.bin", deadline_s=30)
        assert etag.detail["verified_by"] == "md5-etag"
    finally:
        agent.close()
        wrong.close()


def test_concurrent_preloads_of_one_object_are_one_fetch(tmp_path, s3_server, weights):
    agent = _agent(tmp_path, s3_server)
    results = []
    tiers = [Tier.DISK, Tier.DISK, Tier.HOST]
    threads = [threading.Thread(target=lambda t=t: results.append(
        agent.preload("s3://weights/small-c.bin", tier=t, deadline_s=60))) for t in tiers]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status for r in results] == ["succeeded"] * 3
        # One transfer: the second disk request joined it (deduplicated), the host one waited for it.
        assert sum("weight_fetch_s" in r.timings and not r.deduplicated for r in results) == 1
        assert len([o for o in agent.observations() if "weight_fetch_s" in o]) == 1
    finally:
        agent.close()


def test_lru_budget_evicts_the_least_recently_used_but_never_what_a_replica_uses(tmp_path, s3_server, weights):
    agent = _agent(tmp_path, s3_server, max_bytes=9 << 20)  # room for two 4 MiB files
    try:
        a, b, c = (f"s3://weights/small-{n}.bin" for n in "abc")
        assert agent.preload(a, deadline_s=30).status == "succeeded"
        time.sleep(0.01)
        assert agent.preload(b, deadline_s=30).status == "succeeded"
        time.sleep(0.01)
        agent.preload(a, deadline_s=30)  # a used again: b is now the least recent
        result = agent.preload(c, deadline_s=30)
        assert result.status == "succeeded" and result.detail["evicted"] == [b]
        # A "replica" holds c open: with a and c in place, b only fits by evicting a.
        holder = subprocess.Popen(["tail", "-f", str(agent.cache.get(c).path)], stdout=subprocess.DEVNULL)
        try:
            wait_until(lambda: agent.cache.in_use(), timeout=5, what="holder")
            assert agent.state()["weights"][-1]["in_use_by"] or any(w["in_use_by"] for w in agent.state()["weights"])
            result = agent.preload(b, deadline_s=30)
            assert result.detail["evicted"] == [a]
            # Now b (evictable) and c (in use): a bigger-than-left request can only evict b.
            assert agent.evict(c)["kept_because_in_use"] is True
            full = agent.preload(weights["big"], deadline_s=30)
            assert (full.status, full.reason) == ("failed", "no_space")
            assert agent.cache.get(c) is not None
        finally:
            stop_process(holder)
    finally:
        agent.close()


# --- over HTTP: the agent process, auth, kill mid-download, and the actuator's agent backend ---------------------


def _start_agent_process(tmp_path: Path, s3: S3Server, socket: Path | None, port: int, **env_extra):
    return start_agent_process(tmp_path, s3, socket, port, token=TOKEN, **env_extra)


def _peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def test_killing_the_agent_mid_download_leaves_nothing_that_looks_cached(tmp_path, s3_server, weights):
    port = free_port()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    proc = _start_agent_process(tmp_path, s3_server, None, port, PREWARM_AGENT_PRELOAD_STREAMS="2",
                                PREWARM_AGENT_PRELOAD_BUFFER_BYTES=str(256 << 10))
    base = f"http://127.0.0.1:{port}"
    try:
        assert httpx.get(f"{base}/v1/state", timeout=5).status_code == 401
        assert httpx.get(f"{base}/v1/state", headers={"Authorization": "Bearer nope"}, timeout=5).status_code == 401
        def preload_until_killed() -> None:
            try:
                httpx.post(f"{base}/v1/preload", json={"weights_uri": weights["big"], "tier": "disk",
                                                       "deadline_s": 120}, headers=headers, timeout=130)
            except httpx.HTTPError:
                pass  # the agent is killed under it

        request = threading.Thread(target=preload_until_killed, daemon=True)
        request.start()

        def mid_download() -> bool:
            # any point before the end will do (a starved machine may poll past the half-way mark)
            flight = httpx.get(f"{base}/v1/state", headers=headers, timeout=5).json()["in_flight"]
            return bool(flight) and 0 < (flight[0]["bytes_done"] or 0) < BIG_BYTES * 0.9

        wait_until(mid_download, timeout=60, what="download in flight")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        cache = tmp_path / "agent-cache"
        assert list((cache / "weights").iterdir()) == []  # nothing visible as cached
        partial = [p for p in (cache / "tmp").rglob("data")]
        assert partial, "the kill should have left a partial download in staging"
    finally:
        stop_process(proc)
    proc = _start_agent_process(tmp_path, s3_server, None, port)
    try:
        state = httpx.get(f"{base}/v1/state", headers=headers, timeout=5).json()
        assert state["weights"] == [] and list((tmp_path / "agent-cache" / "tmp").iterdir()) == []
        done = httpx.post(f"{base}/v1/preload", json={"weights_uri": weights["big"], "tier": "disk",
                                                       "deadline_s": 120}, headers=headers, timeout=130)
        assert done.status_code == 200 and done.json()["detail"]["sha256"] == weights["big_sha256"]
        # Bounded memory: 256 MiB streamed through an agent whose peak RSS stays well under that.
        assert _peak_rss_bytes(proc.pid) < 256 << 20
        bad = httpx.post(f"{base}/v1/preload", json={"weights_uri": "s3://weights/absent.bin"}, headers=headers,
                         timeout=30)
        assert bad.status_code == 404 and bad.json()["reason"] == "not_found"
        invalid = httpx.post(f"{base}/v1/preload", json={"weights_uri": "http://x/y"}, headers=headers, timeout=5)
        assert invalid.status_code == 422
        evicted = httpx.delete(f"{base}/v1/weights", params={"uri": weights["big"]}, headers=headers, timeout=5)
        assert evicted.status_code == 200 and evicted.json()["evicted_tiers"] == ["disk"]
    finally:
        stop_process(proc)


def test_actuator_agent_backend_end_to_end_records_actions_and_transfers(tmp_path, engine, settings, s3_server,
                                                                        weights, containerd, test_images):
    """Test (e): a pre-pull and a pre-load through the agent leave transfers, never cold starts, and the latency
    model trained afterwards learns its pull and fetch rates from them."""
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id, image_size_bytes, weights_size_bytes) "
                          "VALUES ('llama', 10000000000, 16000000000)"))
    port = free_port()
    proc = _start_agent_process(tmp_path, s3_server, containerd.socket, port)
    now = datetime.now(timezone.utc)
    image = test_images["small"]
    containerd.ctr("images", "rm", image)
    actions = (
        Action(kind=ActionKind.PREPULL, model_id="llama", reason=Reason.CACHE_WARM, not_before=now,
               deadline=now + timedelta(minutes=5), node_id="node-a", target=image),
        Action(kind=ActionKind.PRELOAD, model_id="llama", reason=Reason.SLO_COVER, not_before=now,
               deadline=now + timedelta(minutes=5), node_id="node-a", target="s3://weights/small-a.bin",
               tier=Tier.DISK),
        Action(kind=ActionKind.PRELOAD, model_id="llama", reason=Reason.SLO_COVER, not_before=now,
               deadline=now + timedelta(minutes=5), node_id="node-a", target="s3://weights/absent.bin",
               tier=Tier.DISK),
    )
    backend = AgentBackend(url_template=f"http://127.0.0.1:{port}", token=TOKEN)
    try:
        actuator = Actuator(engine, settings, backend)
        submitted, reports = actuator.apply(Plan(planned_at=now, actions=actions), now=now)
        by_target = {r["target"]: r for r in list_actions(engine, plan_id=submitted.plan_id)}
        assert by_target[image]["status"] == "succeeded"
        assert by_target["s3://weights/small-a.bin"]["status"] == "succeeded"
        assert by_target["s3://weights/absent.bin"]["status"] == "failed"
        assert by_target["s3://weights/absent.bin"]["status_reason"] == "not_found"
        assert by_target[image]["detail"]["timings"]["image_pull_s"] > 0
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT node_id, kind, tier, ref, bytes, seconds, image_pull_s, weight_fetch_s, "
                                     "source FROM transfers ORDER BY kind")).all()
            assert conn.execute(text("SELECT count(*) FROM cold_starts")).scalar() == 0
        assert [(r[1], r[2], r[3]) for r in rows] == [("preload", "disk", "s3://weights/small-a.bin"),
                                                      ("prepull", "image", image)]
        assert rows[0][4] == 4 << 20 and rows[0][7] > 0 and rows[0][6] is None
        assert rows[1][4] > 0 and rows[1][6] > 0 and rows[1][7] is None
        assert {r[0] for r in rows} == {"node-a"} and {r[8] for r in rows} == {"actuator-agent"}
        # Run again: the agent answers "already there", no new observations.
        later = now + timedelta(seconds=1)
        _, reports = actuator.apply(Plan(planned_at=later, actions=actions[:2]), now=later)
        assert [r.status for r in reports] == [ActionStatus.SUCCEEDED] * 2
        assert all(r.detail["already_present"] for r in reports)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM transfers")).scalar() == 2
            assert conn.execute(text("SELECT count(*) FROM cold_starts")).scalar() == 0
        # A wrong token is a permanent 'unauthorised'.
        bad = Actuator(engine, settings, AgentBackend(url_template=f"http://127.0.0.1:{port}", token="wrong"))
        _, reports = bad.apply(Plan(planned_at=later, actions=(actions[0],)), now=later + timedelta(seconds=1))
        assert reports[0].status is ActionStatus.FAILED and reports[0].reason is FailureReason.UNAUTHORISED
    finally:
        backend.close()
        stop_process(proc)
    # The latency model trained now learns the rates the agent measured (the catalogue's 10 GB image and 16 GB of
    # weights pulled and fetched at those rates), moving its predictions from the prior toward them.
    pull_rate = rows[1][4] / rows[1][6]
    fetch_rate = rows[0][4] / rows[0][7]
    models = pd.DataFrame({"image_bytes": [10e9], "weights_bytes": [16e9]}, index=pd.Index(["llama"]))
    prior = load_latency_model(engine, settings).latency_table(models, hour=now.hour).set_index("state")
    train_latency_model(engine, settings, now)
    learned = load_latency_model(engine, settings).latency_table(models, hour=now.hour).set_index("state")
    for phase, rate in (("image_pull_s", pull_rate), ("weight_fetch_s", fetch_rate)):
        seen = (10e9 if phase == "image_pull_s" else 16e9) / rate
        assert abs(learned.loc["none", phase] - seen) < abs(prior.loc["none", phase] - seen), phase
    # The agent is gone: a temporary failure, retried later.
    gone = Actuator(engine, settings, AgentBackend(url_template=f"http://127.0.0.1:{port}", token=TOKEN,
                                                    connect_timeout_s=1))
    retry_now = now + timedelta(seconds=5)
    _, reports = gone.apply(Plan(planned_at=retry_now, actions=(actions[1],)), now=retry_now)
    assert reports[0].status is ActionStatus.PENDING and reports[0].reason is FailureReason.RUNTIME_UNAVAILABLE


def _proc_status_kib(*fields: str) -> dict[str, int]:
    rows = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {f: int(rows[f].split()[0]) for f in fields}


def test_host_tier_locks_the_files_page_cache_not_a_private_copy(tmp_path):
    """The host tier exists so that a replica's load reads the weights from memory: the pinned pages must be the
    file's page cache. A private writable mapping locked with ``mlock`` is faulted in for write, which gives the
    agent an anonymous copy of the whole file (its own memory, charged to its cgroup) and leaves the page cache
    evictable; that is what the tier did until it mapped the file shared and read-only."""
    from forecaster.agent.service import _HostPin

    size = 64 << 20
    path = tmp_path / "data"
    path.write_bytes(os.urandom(size))
    before = _proc_status_kib("RssAnon", "RssFile", "VmLck")
    pin = _HostPin(path, size)
    try:
        after = _proc_status_kib("RssAnon", "RssFile", "VmLck")
        grew_kib = {f: after[f] - before[f] for f in after}
        assert grew_kib["RssAnon"] < (size >> 10) // 4, grew_kib  # no copy of the file in the agent's memory
        if pin.mode == "pinned":  # root here (CAP_IPC_LOCK): the file's own pages are mapped, resident and locked
            assert grew_kib["VmLck"] >= size >> 10 and grew_kib["RssFile"] >= (size >> 10) * 9 // 10, grew_kib
        with open(path, "rb") as handle:  # the mapping is the file's bytes
            handle.seek(size - 4096)
            assert ctypes.string_at(pin._address + size - 4096, 4096) == handle.read(4096)
    finally:
        pin.release()
    assert _proc_status_kib("VmLck")["VmLck"] <= before["VmLck"]


def _cache_entry(cache: WeightsCache, uri: str, size: int) -> None:
    staging = cache.staging_dir(uri)
    (staging / "data").write_bytes(os.urandom(size))
    cache.commit(staging, uri=uri, size=size, sha256=None, fetched_at="2026-12-07T00:00:00+00:00")


def test_space_a_download_has_allocated_is_not_counted_twice(tmp_path):
    """A download reserves its size, then allocates it on disk (``posix_fallocate``): from then on the file
    system's free space no longer holds those bytes, so a second reservation must not subtract them again. Counted
    twice, a second pre-load beside a large one evicted the whole warm cache and then failed as ``no_space``
    (permanent: never retried). A reservation not yet allocated still counts."""
    mib = 1 << 20
    cache = WeightsCache(tmp_path / "cache", reserve_bytes=0)
    for name in ("warm-1", "warm-2"):
        _cache_entry(cache, f"s3://b/{name}", 32 * mib)
    cache.reserve("s3://b/big", 48 * mib)  # the large download in flight, its blocks allocated
    staging = cache.staging_dir("s3://b/big")
    fd = os.open(staging / "data", os.O_RDWR | os.O_CREAT)
    try:
        os.posix_fallocate(fd, 0, 48 * mib)
        cache.allocated("s3://b/big")

        def leave_free(n: int) -> None:  # a small disk: only n bytes free beyond the cache's reserve
            cache.reserve_bytes = shutil.disk_usage(cache.root).free - n

        # 16 MiB of slack either way in each step: other processes writing the same disk cannot flip the outcome
        leave_free(40 * mib)  # counted twice, 40 - 48 MiB: both warm entries evicted, still short
        cache.reserve("s3://b/second", 16 * mib)
        assert cache.last_evicted == [] and len(cache.entries()) == 2
        # "second" has not allocated yet: its 16 MiB are still owed (24 left), so a third of 40 needs one warm
        # entry evicted (32 more: 56), not two.
        leave_free(40 * mib)
        cache.reserve("s3://b/third", 40 * mib)
        assert cache.last_evicted == ["s3://b/warm-1"]
    finally:
        os.close(fd)
        for uri in ("s3://b/big", "s3://b/second", "s3://b/third"):
            cache.release(uri)


class _CuttingS3(threading.Thread):
    """An HTTP server answering S3's HEAD and ranged GET for one object, which closes the connection halfway
    through the body of its first ``cuts`` GETs: a network that drops a long download, as routinely happens on
    multi-GB reads. (The real S3 server cannot be made to do that.)"""

    def __init__(self, data: bytes, cuts: int) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        super().__init__(daemon=True)
        self.data, self.cuts, self.ranges = data, cuts, []
        md5, outer = hashlib.md5(data).hexdigest(), self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(outer.data)))
                self.send_header("ETag", f'"{md5}"')
                self.end_headers()

            def do_GET(self) -> None:
                first, last = (int(v) for v in self.headers["Range"].split("=")[1].split("-"))
                outer.ranges.append((first, last))
                cut = len(outer.ranges) <= outer.cuts
                self.send_response(206)
                self.send_header("Content-Length", str(last - first + 1))
                self.send_header("Content-Range", f"bytes {first}-{last}/{len(outer.data)}")
                self.send_header("ETag", f'"{md5}"')
                self.end_headers()
                self.wfile.write(outer.data[first:first + (last - first + 1) // 2 if cut else last + 1])
                self.wfile.flush()
                if cut:
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)

    def run(self) -> None:
        self.server.serve_forever()


def test_a_download_whose_connection_drops_resumes_where_it_stopped_and_fails_temporarily_at_last(tmp_path):
    data = os.urandom(2 << 20)
    for cuts, succeeds in ((2, True), (100, False)):
        server = _CuttingS3(data, cuts)
        server.start()
        source = S3WeightsSource(endpoint_url=f"http://127.0.0.1:{server.server.server_port}", access_key_id="k",
                                 secret_access_key="s", streams=1, part_bytes=1 << 20)
        fd = os.open(tmp_path / f"data-{cuts}", os.O_RDWR | os.O_CREAT)
        try:
            info = source.head("s3://b/k")
            os.posix_fallocate(fd, 0, len(data))
            if succeeds:  # two cuts: the first part read in three GETs, each from where the last stopped
                digests = source.fetch_into("s3://b/k", info, fd, deadline=time.monotonic() + 30,
                                            algorithms=("md5",))
                assert digests["md5"] == info.md5 == hashlib.md5(data).hexdigest()
                assert os.pread(fd, len(data), 0) == data
                mib = 1 << 20
                assert server.ranges[:3] == [(0, mib - 1), (mib // 2, mib - 1), (3 * mib // 4, mib - 1)]
            else:  # the network keeps dropping it: a temporary failure (the actuator retries), never permanent
                with pytest.raises(AgentError) as failed:
                    source.fetch_into("s3://b/k", info, fd, deadline=time.monotonic() + 30)
                assert failed.value.temporary and "connection dropped" in str(failed.value)
                assert len([r for r in server.ranges if r[0] < 1 << 20]) == 1 + PART_RESUMES  # the first part's
        finally:
            os.close(fd)
            server.server.shutdown()


def test_an_etag_is_taken_as_the_md5_only_where_s3_says_it_is_one(s3_server, weights):
    """SSE-KMS and SSE-C objects have ETags that are not the MD5 of their data: checked against them, every
    pre-load from such a bucket failed as checksum_mismatch. The store here has no KMS, so the HEAD responses of
    encrypted objects are the real one's with the encryption headers AWS adds."""
    from forecaster.agent.weights import etag_md5

    head = s3_server.client().head_object(Bucket="weights", Key="small-b.bin")
    md5 = head["ETag"].strip('"')
    assert _source(s3_server).head("s3://weights/small-b.bin").md5 == etag_md5(head) == md5
    assert etag_md5({**head, "ServerSideEncryption": "AES256"}) == md5  # SSE-S3 keeps the MD5
    assert etag_md5({**head, "ServerSideEncryption": "aws:kms"}) is None
    assert etag_md5({**head, "ServerSideEncryption": "aws:kms:dsse"}) is None
    assert etag_md5({**head, "SSECustomerAlgorithm": "AES256"}) is None
    assert etag_md5({**head, "ETag": f'"{md5}-3"'}) is None  # multipart


def test_weights_overwritten_in_s3_under_the_same_key_are_fetched_again(tmp_path, s3_server, weights):
    """A model's weights replaced under the same URI (a re-published ``latest``): the cached copy is no longer
    them, so a pre-load fetches the new object (its ETag changed), and the host tier holds the new file."""
    client, uri = s3_server.client(), "s3://weights/mutable.bin"
    old, new = os.urandom(2 << 20), os.urandom(3 << 20)
    client.put_object(Bucket="weights", Key="mutable.bin", Body=old)
    agent = _agent(tmp_path, s3_server)
    try:
        assert agent.preload(uri, tier=Tier.HOST, deadline_s=30).status == "succeeded"
        assert agent.preload(uri, deadline_s=30).already_present  # unchanged: a no-op
        client.put_object(Bucket="weights", Key="mutable.bin", Body=new)
        again = agent.preload(uri, tier=Tier.HOST, deadline_s=30)
        assert again.status == "succeeded" and not again.already_present, again.message
        assert "changed in S3" in again.detail["replaced_stale"] and "weight_fetch_s" in again.timings
        assert agent.cache.get(uri).path.read_bytes() == new and again.size_bytes == len(new)
        assert agent.state()["memory"]["host_resident_bytes"] == len(new)
        assert agent.preload(uri, deadline_s=30).already_present
    finally:
        agent.close()


def test_a_request_that_joins_a_transfer_extends_its_deadline(tmp_path, s3_server, weights):
    """The first request for the big object gives up after 0.2 s, a second for the same object joins the transfer
    with a minute: the transfer runs on to the later deadline (it used to stop at the first one, failing both)."""
    agent = _agent(tmp_path, s3_server)
    results = {}
    try:
        first = threading.Thread(target=lambda: results.update(first=agent.preload(weights["big"], deadline_s=0.2)))
        first.start()
        wait_until(lambda: any(u["bytes_done"] for u in agent.state()["in_flight"]), timeout=5,
                   what="the first transfer's first bytes")
        results["second"] = agent.preload(weights["big"], deadline_s=60)
        first.join()
        assert (results["first"].status, results["first"].reason) == ("failed", "timeout")
        assert results["second"].status == "succeeded" and results["second"].deduplicated, results["second"].message
        assert _sha256_file(agent.cache.get(weights["big"]).path) == weights["big_sha256"]
        assert agent._uri_locks == {}  # a URI's lock lives while someone holds or waits for it
    finally:
        agent.close()
