from __future__ import annotations

import os
import socket

from celery import shared_task
from django.db import connection
from django.utils import timezone

from ragsite import audit
from ragsite.beat import BEAT_HEARTBEAT_KEY
from ragsite.redis import Role, redis_client


@shared_task(name="ragsite.tasks.ping")
def ping(value: int) -> dict:
    """Round-trip check: proves a worker process received, ran and answered a task, and
    reached the database (``database_backend``: the PostgreSQL process serving its connection)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = cursor.fetchone()[0]
    return {"value": value + 1, "pid": os.getpid(), "host": socket.gethostname(), "database_backend": backend}


@shared_task(name="ragsite.tasks.beat_heartbeat", ignore_result=True)
def beat_heartbeat() -> None:
    redis_client(Role.BROKER).set(BEAT_HEARTBEAT_KEY, timezone.now().isoformat(), ex=600)


@shared_task(name="ragsite.tasks.audit_purge", ignore_result=True)
def audit_purge() -> int:
    """Daily: audit events past their retention go (ragsite.audit)."""
    return audit.audit_purge()
