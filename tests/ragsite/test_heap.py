"""Web and worker processes freeze their start-up heap (ragsite/heap.py), so that a full
garbage collection under load walks only what was allocated since, not Django's ~170,000
start-up objects (a ~75 ms pause of every stream the process serves)."""

import gc
import json
import os
import subprocess
import sys

import pytest

from ragsite.heap import FullCollectionBackoff
from tests.conftest import PROJECT_ROOT

# Far fewer objects than Django, the SDKs and the views leave behind, far more than a bare
# interpreter's: the freeze took the start-up heap, not a part of it.
STARTUP_OBJECTS_AT_LEAST = 50_000


def _frozen_after(setup: str, freeze: str, modules: tuple[str, ...]) -> dict:
    """In a fresh interpreter: ``setup``, then ``freeze``; the objects frozen before and after
    it, and whether each of ``modules`` was imported by then."""
    code = (
        f"import gc, json, sys\n{setup}\nbefore = gc.get_freeze_count()\n{freeze}\n"
        f"print(json.dumps({{'before': before, 'frozen': gc.get_freeze_count(),\n"
        f"    'imported': [m in sys.modules for m in {modules!r}]}}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=PROJECT_ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "ragsite.settings"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_web_process_freezes_its_heap_once_every_view_is_imported():
    views = ("frontdoors.openai_api.views", "frontdoors.api.views", "openai")
    found = _frozen_after("", "import ragsite.asgi", views)
    assert found == {"before": 0, "frozen": found["frozen"], "imported": [True, True, True]}
    assert found["frozen"] >= STARTUP_OBJECTS_AT_LEAST


def test_a_worker_freezes_its_heap_at_worker_init():
    # A worker imports its task modules before it sends worker_init (celery.worker.WorkController:
    # loader.init_worker, then setup_instance); the test does the same, then sends the signal.
    found = _frozen_after(
        "import django\ndjango.setup()\nfrom ragsite.celery import app\napp.loader.import_default_modules()",
        "from celery.signals import worker_init\nworker_init.send(sender=None)",
        (),
    )
    assert found == {"before": 0, "frozen": found["frozen"], "imported": []}
    assert found["frozen"] >= STARTUP_OBJECTS_AT_LEAST


@pytest.fixture
def thresholds():
    # The heap a full collection walks, whatever ran before in this process: a test that froze
    # it (startup_heap_freeze, as a worker does at start) left it in the permanent generation.
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)
    if frozen:
        gc.freeze()


def _full_collection(backoff: FullCollectionBackoff, found: int, generation: int = 2) -> tuple[int, int, int]:
    backoff.on_collection("stop", {"generation": generation, "collected": found, "uncollectable": 0})
    return gc.get_threshold()


def test_full_collections_that_find_little_are_spaced_out_up_to_a_bound(thresholds):
    backoff = FullCollectionBackoff()
    live = len(gc.get_objects(2))  # the test process's own heap: what a full collection walks
    assert live > 10_000
    spaced = [_full_collection(backoff, found=live // 100)[2] for _ in range(8)]
    assert spaced == [20, 40, 80, 160, 320, 640, 640, 640]
    assert gc.get_threshold()[:2] == (700, 10)  # the young generations keep CPython's pace


def test_a_full_collection_that_finds_garbage_restores_the_default_pace(thresholds):
    backoff = FullCollectionBackoff()
    _full_collection(backoff, found=0)
    _full_collection(backoff, found=0)
    assert gc.get_threshold() == (700, 10, 40)
    # Young collections say nothing about the full ones.
    assert _full_collection(backoff, found=0, generation=1) == (700, 10, 40)
    live = len(gc.get_objects(2))
    assert _full_collection(backoff, found=live // 5) == (700, 10, 10)


def test_the_backoff_is_installed_once_per_process():
    code = (
        "import gc\nfrom ragsite.heap import startup_heap_freeze\n"
        "startup_heap_freeze()\nstartup_heap_freeze()\nprint(len(gc.callbacks))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"
