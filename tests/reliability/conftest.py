"""Fixtures of the fault-injection tests: stop and start the test session's own PostgreSQL and
Redis (tests/embedded_services.py) in place: same data folder, same socket or port, so every
process started before the outage finds them again at the same address.

The services are always started again, even when the test fails, so that the rest of the
suite runs against them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests import embedded_services
from tests.polling import wait_for


@contextmanager
def _outage(service, name: str, start=None) -> Iterator[None]:
    url = service.ensure_running()
    assert service.stop(), f"the test {name} was not running"
    try:
        yield
    finally:
        if start is not None:
            start()
        restarted = service.ensure_running()
        assert restarted == url, f"{name} came back at {restarted}, not at {url}"
        if name == "redis":
            # This process's broker connections (the fixtures' pings and inspections) are stale.
            from kombu import pools

            from ragsite.celery import app

            app._pool = None  # the next use opens new connections, as after a fork
            app.amqp._producer_pool = None
            pools.reset()  # kombu's process-wide producer pools, keyed by the broker's URL


def _redis_start_in_place(service) -> None:
    """Start redis-server with the configuration it ran with, so on the same port: the
    embedded helper would pick a new port while the old one still has connections in
    TIME_WAIT (redis-server itself binds with SO_REUSEADDR)."""
    import subprocess

    from ragsite.embedded import redis_server_binary

    if service.running_port() is None:
        subprocess.run([redis_server_binary(), str(service.data_dir / "redis.conf")], check=True, capture_output=True)
        port = int(service.port_file.read_text())
        wait_for(lambda: service._ping(port), 15, f"redis-server did not come back on port {port}")


@pytest.fixture
def redis_outage():
    """``with redis_outage(): ...``: the session's Redis is stopped (SIGTERM: it writes its
    append-only file and exits) for the block, then started again on the same port with its data."""
    service = embedded_services._REDIS
    return lambda: _outage(service, "redis", start=lambda: _redis_start_in_place(service))


@pytest.fixture
def postgres_outage():
    """``with postgres_outage(): ...``: the session's PostgreSQL is stopped (fast shutdown: open
    transactions roll back, committed data is flushed) for the block, then started again on the
    same socket with its data. The test process's own connection is closed after it."""
    from django.db import connections

    @contextmanager
    def outage():
        try:
            service = embedded_services._POSTGRES
            with _outage(service, "postgres", start=lambda: service._server().ensure_postgres_running()):
                yield
        finally:
            for connection in connections.all():
                connection.close_if_unusable_or_obsolete()
                connection.close()

    return outage
