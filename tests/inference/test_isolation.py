"""A request that crashes, runs out of memory or loses its process fails alone; the worker goes on."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import torch

from inference import tasks
from inference.streams import StreamWriter, stream_read
from inference.tasks import generate_local
from tests.inference.tiny_models import tiny_model_save

PROMPT = "the wing flow of the shock wave is high and the lift of the wing flow is low"


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """A tiny model with room for thousands of tokens: a generation long enough to kill mid-way."""
    path = tmp_path_factory.mktemp("tiny-llama-long")
    return tiny_model_save(path, 5, max_positions=8192)


def texts(events) -> str:
    return "".join(data["text"] for _, kind, data in events if kind == "delta")


def pool_processes(worker_name: str) -> list[int]:
    from ragsite.celery import app

    stats = app.control.inspect(destination=[worker_name], timeout=5).stats()
    return list(stats[worker_name]["pool"]["processes"])


@pytest.mark.slow
def test_a_killed_generation_process_fails_that_request_only(start_worker, long_context_model):
    payload = {"model": long_context_model, "dtype": "float32", "prompt": PROMPT}
    with start_worker(["gpu"]) as worker:
        # Warm the child up (model loaded), and keep the reference text of a short request.
        warm = uuid.uuid4().hex
        generate_local.delay(warm, {**payload, "max_tokens": 16})
        expected_short = texts(stream_read(warm, block_ms=60000))
        [child] = pool_processes(worker.name)

        doomed = uuid.uuid4().hex
        generate_local.delay(doomed, {**payload, "max_tokens": 8000})
        events = stream_read(doomed, block_ms=60000)
        seen = [next(events)]  # the first delta: the generation is under way in the child
        os.kill(child, signal.SIGKILL)
        seen.extend(events)

        # The worker replaced its child and serves the next request in full.
        after = uuid.uuid4().hex
        generate_local.delay(after, {**payload, "max_tokens": 16})
        after_events = list(stream_read(after, block_ms=60000))
        replacement = pool_processes(worker.name)
        worker_alive = worker.process.poll() is None
        # Give a redelivery (the bug this guards against) time to show up, then look again.
        time.sleep(2)
        replay = list(stream_read(doomed, block_ms=1000))

    kinds = [kind for _, kind, _ in seen]
    assert kinds[-1] == "error" and set(kinds[:-1]) == {"delta"}
    assert "stats" not in kinds
    error = seen[-1][2]
    assert error["field"] is None
    assert "worker process" in error["message"] and "signal 9" in error["message"]
    assert 1 <= kinds.count("delta") < 8000
    assert worker_alive and replacement != [child] and len(replacement) == 1
    assert [kind for _, kind, _ in after_events][-1] == "stats"
    assert texts(after_events) == expected_short
    # Not redelivered: the killed request's stream is exactly what the reader saw.
    assert replay == seen


@pytest.mark.django_db
def test_out_of_memory_fails_the_request_and_frees_the_cache(monkeypatch, long_context_model):
    calls = []

    def out_of_memory(*args, **kwargs):
        calls.append(1)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(tasks, "generate", out_of_memory)
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    request_id = uuid.uuid4().hex
    result = generate_local.run(request_id, {"model": long_context_model, "dtype": "float32", "prompt": PROMPT})
    events = list(stream_read(request_id, block_ms=1000))
    assert calls == [1] and emptied == [1]
    assert result == {"error": "out of memory"}
    assert [(kind, data["message"]) for _, kind, data in events] == [
        ("error", "the GPU ran out of memory for this request; try fewer max_tokens or a shorter prompt")
    ]


@pytest.mark.django_db
def test_a_redelivered_request_never_streams_twice(long_context_model):
    """A message redelivered after its worker vanished must not append a second answer."""
    payload = {"model": long_context_model, "dtype": "float32", "prompt": PROMPT, "max_tokens": 8}

    finished = uuid.uuid4().hex
    generate_local.run(finished, payload)
    first = list(stream_read(finished, block_ms=1000))
    assert generate_local.run(finished, payload) == {"skipped": "already finished"}
    assert list(stream_read(finished, block_ms=1000)) == first

    interrupted = uuid.uuid4().hex
    StreamWriter(interrupted).write("delta", text="the wing")
    result = generate_local.run(interrupted, payload)
    events = list(stream_read(interrupted, block_ms=1000))
    assert result == {"error": "interrupted"}
    assert [kind for _, kind, _ in events] == ["delta", "error"]
    assert "not restarted" in events[-1][2]["message"] and "1 event" in events[-1][2]["message"]
