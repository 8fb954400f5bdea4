"""pytest plugin (loaded with ``-p`` before Django settings): real, throwaway services.

Every test run gets its own PostgreSQL 18 + pgvector and Redis, started from the same
embedded binaries the product uses, in a temporary folder that is removed afterwards.
Tests never touch ``var/`` of a developer's running system, and never use SQLite or a
fake Redis.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ragsite.embedded import EmbeddedPostgres, EmbeddedRedis

_ROOT = Path(tempfile.mkdtemp(prefix="ragsite-test-"))
_POSTGRES = EmbeddedPostgres(_ROOT / "pgdata")
_REDIS = EmbeddedRedis(_ROOT / "redis")

os.environ["RAGSITE_VAR_DIR"] = str(_ROOT / "var")
os.environ["DATABASE_URL"] = _POSTGRES.ensure_running()
os.environ["REDIS_URL"] = _REDIS.ensure_running()
os.environ.setdefault("READYZ_WORKER_TIMEOUT", "1.0")
# Prometheus multiprocess mode (ragsite/metrics.py): the processes of this test process share one
# folder. Its own, not inherited: pytest-xdist's workers are started with the environment of the
# process that ran pytest, and one's `manage.py up` would empty the folder another's counters are in.
os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(_ROOT / "prometheus")
# Plain HTTP on loopback, as `dev.py` runs it; tests of the production settings set it themselves.
os.environ.setdefault("RAGSITE_ENV", "development")


def pytest_unconfigure(config):
    _REDIS.stop()
    _POSTGRES.stop()
    shutil.rmtree(_ROOT, ignore_errors=True)
