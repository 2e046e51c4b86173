"""Pytest fixtures: a real Prometheus scraping a ``prometheus_client`` exporter.

``prom_server`` (session scope) starts

* an exporter on a free loopback port, in a thread, with its own registry and
  one counter ``prewarm_test_requests`` (exposed as
  ``prewarm_test_requests_total``) labelled ``model_name``, and
* the ``prometheus`` binary (``PREWARM_TEST_PROMETHEUS`` or ``prometheus`` on
  ``PATH``) on another free loopback port, with a temp config
  (``scrape_interval: 1s``) and a temp TSDB directory,

waits until ``/-/ready`` answers and the exporter has been scraped, and yields
a :class:`PromServer`. Without a ``prometheus`` binary the tests are skipped (and fail under CI).
Prometheus is stopped by its PID at the end (terminate, wait, kill).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from forecaster.ingest.prometheus import escape_promql_string

COUNTER_NAME = "prewarm_test_requests"
SERIES_NAME = "prewarm_test_requests_total"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class PromServer:
    """A running Prometheus that scrapes the test exporter every second.

    Attributes:
        url: Prometheus' base URL (``http://127.0.0.1:PORT``).
        counter: the exporter's ``prewarm_test_requests`` counter (label
            ``model_name``); ``counter.labels(model_name="m").inc(3)``.
        exporter_url: the exporter's ``/metrics`` URL.
        process: the ``prometheus`` process.
    """

    url: str
    counter: Counter
    exporter_url: str
    process: subprocess.Popen
    log_path: Path
    _http: httpx.Client = field(repr=False)

    def query(self, expr: str) -> list[dict]:
        """Instant query at the server's now; the ``result`` list."""
        response = self._http.get(f"{self.url}/api/v1/query", params={"query": expr})
        response.raise_for_status()
        return response.json()["data"]["result"]

    def wait_for_value(self, model_name: str, value: float, timeout: float = 15.0) -> float:
        """Wait until Prometheus' latest scrape of ``model_name``'s counter is ``value``.

        Returns the timestamp (Unix seconds, ms precision) of the first scrape
        that showed ``value`` (the first of the latest run of equal samples),
        i.e. the scrape in which the increments that led to it were counted.
        """
        expr = f'{SERIES_NAME}{{model_name="{escape_promql_string(model_name)}"}}[1m]'
        deadline = time.monotonic() + timeout
        last: object = None
        while True:
            result = self.query(expr)
            if result:
                samples = [(float(t), float(v)) for t, v in result[0]["values"]]
                last = samples[-1][1]
                if last == value:
                    first = len(samples) - 1
                    while first > 0 and samples[first - 1][1] == value:
                        first -= 1
                    return samples[first][0]
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Prometheus did not scrape {expr} == {value} within {timeout} s (last value {last!r}); "
                    f"prometheus log:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def _start_prometheus(binary: str, workdir: Path, exporter_port: int) -> tuple[subprocess.Popen, int, Path]:
    config = workdir / "prometheus.yml"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: prewarm-test\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{exporter_port}']\n"
    )
    last_error = ""
    for attempt in range(3):
        port = _free_port()
        log_path = workdir / f"prometheus-{attempt}.log"
        log = open(log_path, "wb")
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / f'tsdb-{attempt}'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
        )
        log.close()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    return process, port, log_path
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        _stop(process)
        last_error = log_path.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"prometheus did not become ready; last log:\n{last_error}")


@pytest.fixture(scope="session")
def prom_server() -> Iterator[PromServer]:
    """A real Prometheus scraping a ``prometheus_client`` exporter every second."""
    binary = os.environ.get("PREWARM_TEST_PROMETHEUS") or shutil.which("prometheus") or "/usr/bin/prometheus"
    if not os.path.exists(binary):
        message = "no prometheus binary (apt-get install --no-install-recommends prometheus)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs it: a missing binary there is a broken set-up, not a skip
        pytest.skip(message)

    registry = CollectorRegistry()
    counter = Counter(COUNTER_NAME, "Requests per model (test exporter).", ["model_name"], registry=registry)
    exporter, exporter_thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    exporter_port = exporter.server_port
    # A series that exists from the start, so "the exporter has been scraped"
    # can be waited for.
    counter.labels(model_name="__ready__").inc(0)

    workdir = Path(tempfile.mkdtemp(prefix="prewarm-prom-"))
    process = None
    http = httpx.Client(timeout=5)
    try:
        process, port, log_path = _start_prometheus(binary, workdir, exporter_port)
        server = PromServer(
            url=f"http://127.0.0.1:{port}",
            counter=counter,
            exporter_url=f"http://127.0.0.1:{exporter_port}/metrics",
            process=process,
            log_path=log_path,
            _http=http,
        )
        # Prometheus applies discovered targets only every 5 s: the first
        # scrape comes about 5 s after start-up.
        server.wait_for_value("__ready__", 0, timeout=20)
        yield server
    finally:
        http.close()
        if process is not None:
            _stop(process)
        exporter.shutdown()
        exporter.server_close()
        exporter_thread.join(timeout=5)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def past_now():
    """A 'now' in the past: the source never asks Prometheus about minutes after the real clock."""
    from datetime import datetime, timedelta, timezone

    return datetime.now(timezone.utc).replace(second=0, microsecond=0) - timedelta(minutes=10)


def ingest_settings(settings, prom_server: PromServer, **more):
    """The test settings pointed at ``prom_server``: a 2-minute lag, 30 minutes of backfill, ``more`` on top."""
    return settings.model_copy(update={"prometheus_url": prom_server.url, "prometheus_lag_s": 120,
                                       "prometheus_backfill_minutes": 30, **more})
