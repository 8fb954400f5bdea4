"""Migrations behind a real PgBouncer in transaction mode: on ``DATABASE_DIRECT_URL`` when it is
set, nothing of them through the pooler. The system itself behind PgBouncer: test_scale_out.py."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import httpx
import psycopg
import pytest
from django.db import connection
from psycopg import sql

from tests.conftest import PROJECT_ROOT, database_url_for_current_test_db
from tests.pgbouncer import REPLICA, PgBouncer

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PASSWORD = "correct horse battery staple"


@pytest.fixture(scope="module")
def pgbouncer(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock():
        params = connection.get_connection_params()
        bouncer = PgBouncer(params["host"], int(params.get("port") or 5432), replica_of=params["dbname"])
    try:
        yield bouncer
    finally:
        bouncer.stop()


def pooled_env(bouncer: PgBouncer) -> dict[str, str]:
    """What a deployment behind PgBouncer sets: every connection through the pooler, the
    ranking and reports on a replica, migrations (none here) direct."""
    return {
        "DATABASE_URL": bouncer.url(connection.settings_dict["NAME"]),
        "DATABASE_TRANSACTION_POOLING": "true",
        "DATABASE_REPLICA_URL": bouncer.url(REPLICA),
        "DATABASE_DIRECT_URL": database_url_for_current_test_db(),
    }


def csrf(browser: httpx.Client) -> str:
    return browser.cookies["csrftoken"]


def test_migrations_run_on_the_direct_url_and_nothing_of_them_through_the_pooler(pgbouncer):
    name = f"ragsite_migrate_{uuid.uuid4().hex[:8]}"
    direct = database_url_for_current_test_db()
    with psycopg.connect(direct, autocommit=True) as server:
        server.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        direct_new = direct.rsplit("/", 1)[0] + f"/{name}"
        env = {
            **pooled_env(pgbouncer),
            "DATABASE_URL": pgbouncer.url(name),
            "DATABASE_DIRECT_URL": direct_new,
            "DATABASE_REPLICA_URL": "",
        }
        migrated = subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput"],
            cwd=PROJECT_ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert migrated.returncode == 0, migrated.stderr[-4000:]
        assert "Applying search.0001_initial... OK" in migrated.stdout
        assert pgbouncer.transactions(name) == 0, pgbouncer.stats().get(name)
        with psycopg.connect(direct_new) as database:
            applied = database.execute("SELECT count(*) FROM django_migrations WHERE app = 'search'").fetchone()[0]
        assert applied > 10
        # The same command with no direct URL goes through the pooler: the count above is the proof.
        again = subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput"],
            cwd=PROJECT_ROOT, env={**os.environ, **env, "DATABASE_DIRECT_URL": ""}, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert again.returncode == 0, again.stderr[-4000:]
        assert "No migrations to apply." in again.stdout
        assert pgbouncer.transactions(name) > 0
    finally:
        with psycopg.connect(direct, autocommit=True) as server:
            server.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
