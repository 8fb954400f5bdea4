"""Web and worker processes freeze their start-up heap (ragsite/heap.py), so that a full
garbage collection under load walks only what was allocated since, not Django's ~170,000
start-up objects (a ~75 ms pause of every stream the process serves)."""

import json
import os
import subprocess
import sys

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
