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


def test_a_worker_freezes_its_heap_when_ready_and_in_each_pool_process():
    found = _python(
        "import gc, json, django\n"
        "django.setup()\n"
        "from celery.signals import worker_process_init, worker_ready\n"
        "from ragsite.celery import app\n"
        "before = gc.get_freeze_count()\n"
        "worker_process_init.send(sender=None)\n"
        "in_pool_process = gc.get_freeze_count()\n"
        "gc.unfreeze()\n"
        "worker_ready.send(sender=None)\n"
        "print(json.dumps({'before': before, 'pool_process': in_pool_process, 'ready': gc.get_freeze_count()}))"
    )
    assert found["before"] == 0
    assert found["pool_process"] >= STARTUP_OBJECTS_AT_LEAST
    assert found["ready"] >= STARTUP_OBJECTS_AT_LEAST
