"""`prewarm serve` as a real process, and a schemathesis fuzz run of its OpenAPI schema: no 5xx anywhere.

The same fuzz run by hand (README):
    schemathesis run http://127.0.0.1:8080/openapi.json -H "Authorization: Bearer $TOKEN" \
        --checks not_a_server_error --max-examples 50 --exclude-path /readyz
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from forecaster.cli import app as cli
from tests.runtime_fixtures import stop_process

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(db_url, tmp_path):
    env = {**os.environ, "DATABASE_URL": db_url, "PREWARM_DATA_DIR": str(tmp_path)}
    runner = CliRunner()
    created = runner.invoke(cli, ["token", "create", "fuzz", "--scope", "admin"], env=env)
    assert created.exit_code == 0, created.output
    token = created.output.strip().splitlines()[-1]
    assert token.startswith("pw_")
    reader = runner.invoke(cli, ["token", "create", "reader", "--scope", "read"], env=env).output.strip()
    port = _free_port()
    process = subprocess.Popen([str(BIN / "prewarm"), "serve", "--port", str(port), "--no-scheduler"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("prewarm serve did not answer within 60 s")
        yield url, token, reader.splitlines()[-1]
    finally:
        stop_process(process)


def test_serve_answers_with_tokens_from_the_cli(served):
    url, admin, reader = served
    put = httpx.put(f"{url}/v1/models/llama", json={"replica_rps": 3}, headers={"Authorization": f"Bearer {admin}"})
    assert put.status_code == 200
    listed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {reader}"}).json()
    assert listed["count"] == 1 and listed["data"][0]["replica_rps"] == 3.0
    assert httpx.get(f"{url}/v1/models").status_code == 401


def test_schemathesis_finds_no_server_error(served, tmp_path):
    url, admin, _ = served
    schemathesis = shutil.which("schemathesis", path=str(BIN)) or shutil.which("schemathesis")
    if schemathesis is None:
        pytest.fail("schemathesis is not installed (it is in the test extra)")
    result = subprocess.run(
        [schemathesis, "run", f"{url}/openapi.json", "-H", f"Authorization: Bearer {admin}",
         "--checks", "not_a_server_error", "--max-examples", "25", "--seed", "1",
         "--phases", "examples,coverage,fuzzing", "--request-timeout", "10",
         # /readyz answers 503 by design while forecasts are missing: that is its job, not a crash
         "--exclude-path", "/readyz"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    generated = re.search(r"(\d+) generated, (\d+) passed", result.stdout)
    assert generated and int(generated.group(2)) == int(generated.group(1)) >= 200, result.stdout[-2000:]
