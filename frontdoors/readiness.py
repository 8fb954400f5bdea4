"""Liveness and readiness.

``/healthz`` answers as long as the web process can run a view: it touches nothing
else, so a load balancer does not restart web processes because the database blinked.
``/readyz`` checks what a request needs: the database, Redis, the uploads' storage, at least one worker
consuming each queue (a broadcast ping over the broker, answered by workers), and at least
one device answering ``/health`` in each enabled GPU pool (every device that does not is
named, with the reason). A pool that is warming (starting: ``Provider.warming_since``) is
shown as such and does not make the system unready: answers are extractive meanwhile.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import redis
from django.conf import settings
from django.db import connection
from django.http import JsonResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from billing import ledger
from inference.models import Provider
from inference.pool import device_health
from ragsite.beat import BEAT_HEARTBEAT_KEY
from ragsite.celery import Queue, app
from ragsite.redis import Role, redis_probe_client, redis_url
from ragsite.storage import storage_status


def _check_database() -> dict:
    started = time.perf_counter()
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
            row = cursor.fetchone()
    except Exception as exc:  # any driver error means "not ready", with the reason shown
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}".strip()}
    return {
        "ok": True,
        "ms": round((time.perf_counter() - started) * 1000, 1),
        "pgvector": row[0] if row else None,
    }


def _check_redis() -> dict:
    """Each role's Redis (one ping per distinct server: by default they are all REDIS_URL);
    a role whose server does not answer is named."""
    started = time.perf_counter()
    failed = {}
    for roles in _roles_by_url().values():
        try:
            redis_probe_client(roles[0]).ping()
        except redis.RedisError as exc:
            failed |= dict.fromkeys(roles, f"{type(exc).__name__}: {exc}")
    if failed:
        return {"ok": False, "error": "; ".join(f"{role}: {reason}" for role, reason in failed.items())}
    return {"ok": True, "ms": round((time.perf_counter() - started) * 1000, 1)}


def _roles_by_url() -> dict[str, list[Role]]:
    by_url: dict[str, list[Role]] = {}
    for role in Role:
        by_url.setdefault(redis_url(role), []).append(role)
    return by_url


def _check_queues() -> dict:
    """Workers per queue, from the queues each live worker reports it consumes."""
    result = {queue.value: {"ok": False, "workers": []} for queue in Queue}
    try:
        replies = app.control.inspect(timeout=settings.READYZ_WORKER_TIMEOUT).active_queues() or {}
    except Exception as exc:  # broker unreachable: every queue is not ready, for that reason
        for entry in result.values():
            entry["error"] = f"{type(exc).__name__}: {exc}"
        return result
    for worker, queues in sorted(replies.items()):
        for queue in queues or []:
            entry = result.get(queue.get("name"))
            if entry is not None:
                entry["workers"].append(worker)
                entry["ok"] = True
    return result


def _check_pools() -> dict:
    """Each enabled GPU pool's devices: ready when its engine server answers ``/health``."""
    pools = list(Provider.objects.filter(kind=Provider.Kind.LOCAL, enabled=True).order_by("name"))
    urls = sorted({url for pool in pools for url in pool.devices})
    with ThreadPoolExecutor(max_workers=min(16, len(urls) or 1)) as probes:
        errors = dict(zip(urls, probes.map(device_health, urls), strict=True))
    result = {}
    for pool in pools:
        devices = {
            url: ({"ok": True} if not errors[url] else {"ok": False, "error": errors[url]}) for url in pool.devices
        }
        not_ready = [f"{url} ({errors[url]})" for url in pool.devices if errors[url]]
        ok = len(not_ready) < len(pool.devices) and pool.warming_since is None
        entry = {"ok": ok, "state": "ready" if ok else "not ready", "devices": devices}
        if pool.warming_since is not None:
            # Starting: answers are extractive meanwhile, so the system is ready without it.
            entry.update(state="warming", warming_since=pool.warming_since.isoformat())
            entry["note"] = "the engine servers are starting; answers are extractive until the pool is ready"
        if not_ready:
            entry["not_ready"] = f"device{'s' if len(not_ready) > 1 else ''} not ready: {'; '.join(not_ready)}"
        result[pool.name] = entry
    return result


def _beat_last_seen() -> str | None:
    try:
        raw = redis_probe_client(Role.BROKER).get(BEAT_HEARTBEAT_KEY)
    except redis.RedisError:
        return None
    if raw is None:
        return None
    return datetime.fromisoformat(raw.decode()).isoformat()


def readiness_summary() -> dict:
    database = _check_database()
    redis_status = _check_redis()
    queues = (
        _check_queues()
        if redis_status["ok"]
        else {queue.value: {"ok": False, "workers": [], "error": "redis unreachable"} for queue in Queue}
    )
    pools = _check_pools() if database["ok"] else {}
    storage = storage_status()
    ready = (
        database["ok"]
        and redis_status["ok"]
        and storage["ok"]
        and all(entry["ok"] for entry in queues.values())
        and all(entry["ok"] or entry["state"] == "warming" for entry in pools.values())
    )
    return {
        "status": "ready" if ready else "not ready",
        "time": timezone.now().isoformat(),
        "checks": {"database": database, "redis": redis_status, "storage": storage, "queues": queues, "pools": pools},
        # Informational: beat being down delays periodic work but does not block requests.
        "beat_last_seen": _beat_last_seen() if redis_status["ok"] else None,
        # Informational: usage rows waiting to be stored, and rows PostgreSQL refused (docs/operations.md).
        "ledger": _ledger_backlog() if redis_status["ok"] else None,
    }


def _ledger_backlog() -> dict | None:
    try:
        return ledger.usage_outbox_backlog(redis_probe_client(Role.STREAMS))
    except redis.RedisError:
        return None


@never_cache
@require_GET
def healthz(request):
    return JsonResponse({"status": "ok"})


@never_cache
@require_GET
def readyz(request):
    summary = readiness_summary()
    response = JsonResponse(summary, status=200 if summary["status"] == "ready" else 503)
    # "Not ready" is an expected state that load balancers poll for, not a server error:
    # keep it out of the error log (Django logs every 5xx unless told it was handled).
    response._has_been_logged = True
    return response
