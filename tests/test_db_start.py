"""Opening the database: a server that refuses the connection fails at once.

* A server that refuses the connection (a wrong password, an unknown role, a missing database, ``sslmode=require``
  without SSL) fails :func:`wait_for_database` at once, saying what to check; a server not answering is waited for.
"""

from __future__ import annotations

import time

import pytest

from forecaster.store.db import DatabaseUnavailable, make_engine, wait_for_database


# --- refusals fail at once ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case, expected", [
    ("wrong password", "authentication failed"),
    ("unknown role", "authentication failed"),
    ("missing database", "the database does not exist"),
    ("sslmode=require, server without SSL", "SSL negotiation failed"),
])
def test_a_refused_connection_fails_at_once_saying_what_to_check(password_postgres, case, expected):
    url = {
        "wrong password": password_postgres.url(password="Wr0ngPassw0rd"),
        "unknown role": password_postgres.url(user="nobody", password="Wr0ngPassw0rd"),
        "missing database": password_postgres.url(database="no_such_db"),
        "sslmode=require, server without SSL": password_postgres.url(query="?sslmode=require"),
    }[case]
    engine = make_engine(url)
    started = time.monotonic()
    try:
        with pytest.raises(DatabaseUnavailable) as info:
            wait_for_database(engine, timeout_s=5, poll_s=0.1)
    finally:
        engine.dispose()
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert elapsed < 3, f"{case}: retried for {elapsed:.1f} s before failing"
    assert type(info.value).__name__ == "DatabaseRefused"
    assert "refused the connection" in message and expected in message, message
    assert "did not answer" not in message
    assert password_postgres.password not in message and "Wr0ngPassw0rd" not in message
    assert "\n" not in message


def test_a_server_that_does_not_answer_is_still_waited_for():
    """Connection refused (nothing listens yet: a server starting) is worth waiting for, up to the timeout."""
    from tests.runtime_fixtures import free_port

    engine = make_engine(f"postgresql+psycopg://postgres:S3cret@127.0.0.1:{free_port()}/postgres")
    started = time.monotonic()
    try:
        with pytest.raises(DatabaseUnavailable) as info:
            wait_for_database(engine, timeout_s=1.0, poll_s=0.1)
    finally:
        engine.dispose()
    assert time.monotonic() - started >= 1.0
    assert type(info.value) is DatabaseUnavailable
    assert "did not answer within 1 s" in str(info.value) and "S3cret" not in str(info.value)


def test_the_right_password_still_connects(password_postgres):
    engine = make_engine(password_postgres.url())
    try:
        wait_for_database(engine, timeout_s=5, poll_s=0.1)
    finally:
        engine.dispose()
