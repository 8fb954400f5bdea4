"""The Celery application: named queues, routing by task, and the defaults every task shares.

Queues:
- ``ingest``: parsing, chunking and embedding documents (CPU-heavy, long);
- ``gpu``: generation on a GPU pool (a threads-pool worker holds many calls at once, each
  streamed from a device's engine server, which batches them);
- ``remote``: generation on an OpenAI-compatible upstream (a threads-pool worker too, apart
  so that a slow upstream never holds the pool's dispatch slots, nor the reverse);
- ``default``: everything short (housekeeping, beat jobs, pings).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from enum import StrEnum

import kombu
import redis
from celery import Celery
from celery.signals import task_postrun, task_prerun, worker_init
from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections
from kombu import Queue as KombuQueue
from kombu.transport.redis import Channel as RedisChannel

from ragsite.beat import BEAT_SCHEDULE
from ragsite.heap import startup_heap_freeze
from ragsite.logs import install_celery_hooks
from ragsite.redis import Role, redis_client
from ragsite.storage import StorageUnavailable, storage_check

logger = logging.getLogger(__name__)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ragsite.settings")


class Queue(StrEnum):
    INGEST = "ingest"
    GPU = "gpu"
    REMOTE = "remote"
    DEFAULT = "default"


# Kombu's Redis transport: the priority steps of a queue and the separator of their lists.
PRIORITY_STEPS = (0, 3, 6, 9)
PRIORITY_SEPARATOR = "\x06\x16"


def queue_lists(queue: str) -> list[str]:
    """The Redis lists holding ``queue``'s waiting messages, one per priority step."""
    return [queue if step == 0 else f"{queue}{PRIORITY_SEPARATOR}{step}" for step in PRIORITY_STEPS]


def unacked_restore(queues: Iterable[str]) -> int:
    """Put the messages that consumers of ``queues`` took and never acknowledged (kombu's
    Redis ``unacked`` hash) back at the head of their queues now, instead of after the
    visibility timeout; returns how many.

    Only for a supervisor that knows every consumer of those queues is dead (``manage.py
    up``, where each queue has one worker and it has just been killed): a live worker's
    message would run twice.
    """
    wanted = set(queues)
    restored = 0
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        for tag, raw in channel.client.hgetall(channel.unacked_key).items():
            _payload, _exchange, routing_key = json.loads(raw)
            if routing_key in wanted:  # each queue's routing key is its name (task_queues below)
                channel.qos.restore_by_tag(tag, leftmost=True)
                restored += 1
    return restored


def queue_depth(queue: str, client: redis.Redis | None = None) -> int:
    """Messages waiting in ``queue`` for a worker (all priority steps)."""
    pipe = (client or redis_client(Role.BROKER)).pipeline(transaction=False)
    for name in queue_lists(queue):
        pipe.llen(name)
    return sum(pipe.execute())


# Routing by task module: a task lands on its app's queue without every call site
# having to remember it. Order matters: the first matching pattern wins.
TASK_ROUTES = {
    # The sweep of answers whose message was lost is short: it must not wait behind ingestion.
    "search.tasks.answers_*": {"queue": Queue.DEFAULT.value},
    "search.tasks.*": {"queue": Queue.INGEST.value},
    # Canary analysis is a short database job: it must not wait behind generations on gpu.
    "inference.tasks.canary_analyse": {"queue": Queue.DEFAULT.value},
    # Likewise the sweep of generations whose message was lost (inference/pending.py).
    "inference.tasks.generations_lost_requeue": {"queue": Queue.DEFAULT.value},
    "inference.tasks.*": {"queue": Queue.GPU.value},
    "billing.tasks.*": {"queue": Queue.DEFAULT.value},
    "*": {"queue": Queue.DEFAULT.value},
}

app = Celery("ragsite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.update(
    task_queues=[KombuQueue(queue.value, routing_key=queue.value) for queue in Queue],
    task_default_queue=Queue.DEFAULT.value,
    task_routes=TASK_ROUTES,
    # JSON only: pickle would let anyone who can write to the broker run code in a worker.
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_accept_content=["json"],
    # A task is acknowledged after it finishes, so a crashed worker's task is redelivered;
    # long tasks additionally set reject_on_worker_lost (LONG_TASK_OPTIONS below).
    task_acks_late=True,
    # One message at a time per process: a long ingest or generation must not hold
    # other messages hostage in its prefetch buffer.
    worker_prefetch_multiplier=1,
    task_track_started=True,
    result_expires=3600,
    broker_connection_retry_on_startup=True,
    # broker_transport_options (the visibility timeout): settings.CELERY_BROKER_TRANSPORT_OPTIONS.
    worker_cancel_long_running_tasks_on_connection_loss=True,
    timezone="UTC",
    enable_utc=True,
)


app.conf.beat_schedule = BEAT_SCHEDULE


# A worker's processes (prefork) or threads embed at the same time: each gets its share of
# the cores. torch's own default, every core in every process, oversubscribed a 2-core host
# (the citation checks of 16 concurrent answers ran a third as fast: docs/benchmarks.md,
# "Load"). Read by search.embedders when it loads a model (settings.EMBEDDING_THREADS).
CPU_SHARE_ENV = "RAGSITE_CPU_SHARE"


@worker_init.connect
def _cpu_share_set(sender=None, **_):
    concurrency = getattr(sender, "concurrency", None) or 1
    os.environ[CPU_SHARE_ENV] = str(max(1, (os.cpu_count() or 1) // concurrency))


@worker_init.connect
def _storage_checked(**_):
    """A worker that cannot read the uploads (a missing bucket, refused credentials) stops at
    start, saying why, rather than failing every ingestion it takes (ragsite/storage.py).
    SystemExit: Celery logs and ignores an Exception raised by a signal's receiver."""
    try:
        storage_check()
    except StorageUnavailable as exc:
        logger.critical("worker not started: %s", exc)
        raise SystemExit(f"worker not started: {exc}") from None


@worker_init.connect
def _startup_heap_frozen(**_):
    """A worker's start-up heap frozen (ragsite/heap.py) once its task modules are imported
    (Celery imports them before ``worker_init``) and before a prefork pool starts: its
    processes inherit the frozen heap, and their collections never touch those pages (no
    copy-on-write of the parent's heap in every child)."""
    startup_heap_freeze()


@task_prerun.connect
@task_postrun.connect
def _database_connections_checked(task=None, **_):
    """A task's thread keeps its database connection across tasks (settings.CELERY_DB_REUSE_MAX
    stops the fixup's close) and checks it as Django does around a web request: closed when
    older than CONN_MAX_AGE or broken, pinged before its next use. Not for an eager task, which
    runs inside its caller's transaction."""
    if task is not None and not getattr(task.request, "is_eager", False):
        close_old_connections()


# The one patch of a library here (kombu's private Channel._connparams, below), checked on the
# kombu it was verified with (requirements.txt pins it).
_KOMBU_VERIFIED = (5, 7)
if tuple(map(int, kombu.__version__.split(".")[:2])) != _KOMBU_VERIFIED or not hasattr(RedisChannel, "_connparams"):
    raise ImproperlyConfigured(
        f"ragsite/celery.py patches kombu's private redis Channel._connparams, verified on kombu "
        f"{'.'.join(map(str, _KOMBU_VERIFIED))}; this is {kombu.__version__}: check it and update _KOMBU_VERIFIED"
    )


def _connparams_of_open_channels(connparams):
    """Celery 5.7's consumer, on losing the broker, ``collect()``s its connection (which drops
    the transport's reference to it) before closing it. The Redis channel then builds a new
    client for its last words (restoring unacknowledged messages on close, acknowledging a
    task that finished after the loss) and fails with an AttributeError, which is not a
    connection error, so nothing ignores it and the worker stops ("Unrecoverable error")
    instead of reconnecting. Found by restarting Redis under a running worker
    (tests/reliability/test_faults.py). A connection error instead: the close is ignored,
    the acknowledgement logged, and the messages stay in Redis's unacknowledged set, from
    which the visibility timeout brings them back."""

    def guarded(self, asynchronous=False):
        if self.connection.client is None:
            raise redis.ConnectionError("this channel's broker connection was closed after it was lost")
        return connparams(self, asynchronous)

    return guarded


RedisChannel._connparams = _connparams_of_open_channels(RedisChannel._connparams)
app.autodiscover_tasks()
# Django's LOGGING in workers and beat; the request id in task headers (ragsite/logs.py).
install_celery_hooks()

# Options for long tasks that are safe to run again (ingestion): redelivered if the worker
# process dies mid-task, bounded by soft and hard limits from settings. Generation is not
# safe to repeat once it has streamed tokens: see inference.tasks.GENERATION_TASK_OPTIONS.
LONG_TASK_OPTIONS = {
    "acks_late": True,
    "reject_on_worker_lost": True,
}
