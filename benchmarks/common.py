"""Shared helpers: Django set-up, machine description, result files."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CRANFIELD = ROOT.parent / "shared" / "data" / "cranfield"


def django_setup() -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ragsite.settings")
    import django

    django.setup()


@contextlib.contextmanager
def own_databases(database: str, redis_db: int, *, keep: bool = False):
    """A PostgreSQL database of the benchmark's own on the project's server (``DATABASE_URL``,
    else the embedded one), created empty and migrated, and Redis database ``redis_db`` of the
    project's server, emptied: a benchmark never meets a running system's rows, queues or
    streams. Django is set up on them inside; the database is dropped after unless ``keep``."""
    import psycopg
    from psycopg import sql

    from benchmarks.search_scale import server_url, with_database

    def drop(conn):
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))

    server = server_url()
    with psycopg.connect(server, autocommit=True) as conn:
        drop(conn)
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    os.environ["DATABASE_URL"] = with_database(server, database)
    os.environ["REDIS_URL"] = redis_database_url(redis_db)
    django_setup()

    from django.core.management import call_command
    from django.db import connections

    try:
        call_command("migrate", verbosity=0)
        yield
    finally:
        connections.close_all()
        if not keep:
            with psycopg.connect(server, autocommit=True) as conn:
                drop(conn)


def redis_database_url(number: int) -> str:
    """Database ``number`` of the project's Redis (the embedded server unless REDIS_URL), emptied."""
    from urllib.parse import urlsplit, urlunsplit

    import redis

    url = os.environ.get("REDIS_URL")
    if not url:
        from ragsite import embedded

        url = embedded.redis_url()
    url = urlunsplit(urlsplit(url)._replace(path=f"/{number}"))
    redis.Redis.from_url(url).flushdb()
    return url


def machine() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }


def report(name: str, result: dict) -> None:
    """Write benchmarks/results/NAME.json and print the final JSON line."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, **result, "machine": machine()}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(payload), flush=True)
