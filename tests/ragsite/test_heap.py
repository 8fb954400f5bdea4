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


def _python(code: str) -> dict:
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
    found = _python(
        "import gc, json, sys\n"
        "before = gc.get_freeze_count()\n"
        "import ragsite.asgi\n"
        "print(json.dumps({'before': before, 'frozen': gc.get_freeze_count(),\n"
        "    'views': [m in sys.modules for m in ('frontdoors.openai_api.views', 'frontdoors.api.views', 'openai')]}))"
    )
    assert found["before"] == 0
    assert found["frozen"] >= STARTUP_OBJECTS_AT_LEAST
    assert found["views"] == [True, True, True]


def test_a_worker_freezes_its_heap_with_its_tasks_imported_before_its_pool_starts():
    found = _python(
        "import gc, json, django\n"
        "django.setup()\n"
        "from celery.signals import worker_init\n"
        "from ragsite.celery import app\n"
        "app.loader.import_default_modules()\n"  # what a worker does before worker_init
        "before = gc.get_freeze_count()\n"
        "worker_init.send(sender=None)\n"
        "import sys\n"
        "print(json.dumps({'before': before, 'frozen': gc.get_freeze_count(),\n"
        "    'tasks': [m in sys.modules for m in ('inference.tasks', 'search.tasks', 'billing.tasks')]}))"
    )
    assert found["before"] == 0
    assert found["frozen"] >= STARTUP_OBJECTS_AT_LEAST
    assert found["tasks"] == [True, True, True]
