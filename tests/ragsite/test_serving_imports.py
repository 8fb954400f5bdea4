"""The serving path loads no torch: the web process (the ASGI application with every view of
its URL map) and a worker's task modules import neither ``torch`` nor ``transformers`` at
start. The embedder loads them when it first embeds, the reference engine only in its own
server process (``python -m inference.engine.server``), tests and benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import PROJECT_ROOT

PROBE = """
import json, os, sys
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ragsite.settings")
if sys.argv[1] == "web":
    from ragsite.asgi import application  # noqa: F401
    from django.urls import get_resolver
    get_resolver().url_patterns  # imports every view module of the URL map
    from django.core.handlers.asgi import ASGIHandler
    ASGIHandler().load_middleware(is_async=True)
else:
    import django
    django.setup()
    from ragsite.celery import app
    app.loader.import_default_modules()  # what a worker imports before it takes a task
    import inference.remote, inference.tasks, search.tasks, billing.tasks  # noqa: E401, F401
print(json.dumps({
    "heavy": sorted(m for m in ("torch", "transformers", "sentence_transformers") if m in sys.modules),
    "engine": sorted(m for m in sys.modules if m.startswith("inference.engine")),
    "tasks_loaded": "inference.tasks" in sys.modules,
}))
"""


def _probe(kind: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, kind], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_web_application_loads_no_torch():
    assert _probe("web") == {"heavy": [], "engine": [], "tasks_loaded": True}


def test_a_workers_task_modules_load_no_torch():
    assert _probe("worker") == {"heavy": [], "engine": [], "tasks_loaded": True}
