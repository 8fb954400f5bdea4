"""Uploads on an S3 API server (``STORAGE_S3_BUCKET``): a missing bucket or refused credentials
stop a worker and ``up`` at start and make ``/readyz`` say so, naming what to fix. Uploads
written by the web process and read by a worker in another process: test_scale_out.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ragsite.storage import storage_status
from tests.conftest import PROJECT_ROOT, database_url_for_current_test_db
from tests.frontdoors.test_up import _free_port as free_port
from tests.s3_server import BUCKET, S3Server

pytestmark = pytest.mark.slow

S3_BACKEND = "storages.backends.s3.S3Storage"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("s3"))
    try:
        yield server
    finally:
        server.stop()


def s3_storage(settings, s3: S3Server, bucket: str, secret: str) -> None:
    """The settings a process with these STORAGE_S3_* and AWS_* variables would have."""
    settings.STORAGE_S3_BUCKET, settings.STORAGE_S3_ENDPOINT_URL = bucket, s3.endpoint_url
    options = {
        "bucket_name": bucket, "endpoint_url": s3.endpoint_url, "region_name": "us-east-1",
        "access_key": s3.access_key_id, "secret_key": secret,
    }  # fmt: skip
    settings.STORAGES = {**settings.STORAGES, "default": {"BACKEND": S3_BACKEND, "OPTIONS": options}}


def test_a_missing_bucket_or_refused_credentials_are_named_by_readiness(s3, settings):
    s3_storage(settings, s3, "nowhere", s3.secret_access_key)
    missing = f"uploads cannot be stored: the bucket 'nowhere' (STORAGE_S3_BUCKET) at {s3.endpoint_url} does not exist"
    assert storage_status() == {"ok": False, "where": f"s3://nowhere/ at {s3.endpoint_url}", "error": missing}
    s3_storage(settings, s3, BUCKET, "wrong")
    refused = storage_status()
    assert refused["ok"] is False
    assert refused["error"] == (
        f"uploads cannot be stored: the bucket '{BUCKET}' (STORAGE_S3_BUCKET) at {s3.endpoint_url} refuses these "
        "credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or the role's policy)"
    )
    s3_storage(settings, s3, BUCKET, s3.secret_access_key)
    assert storage_status()["ok"] is True


@pytest.mark.django_db(transaction=True)
def test_a_worker_and_up_refuse_to_start_without_their_bucket(s3, tmp_path):
    env = {
        **os.environ,
        **s3.env(bucket="nowhere"),
        "DATABASE_URL": database_url_for_current_test_db(),
        "RAGSITE_VAR_DIR": str(tmp_path / "var"),
        "GPU_POOL_MODEL": "off",
        "PYTHONUNBUFFERED": "1",
    }
    worker = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "ragsite", "worker", "-Q", "ingest", "-c", "1", "--without-gossip",
         "--without-mingle"],
        cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    reason = f"uploads cannot be stored: the bucket 'nowhere' (STORAGE_S3_BUCKET) at {s3.endpoint_url} does not exist"
    assert worker.returncode != 0
    assert f"worker not started: {reason}" in worker.stdout + worker.stderr

    up = subprocess.run(
        [sys.executable, "manage.py", "up", "--port", str(free_port()), "--no-demo"],
        cwd=PROJECT_ROOT, env={**env, **s3.env(secret="wrong")}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert up.returncode == 1, up.stdout + up.stderr
    assert f"uploads:  s3://{BUCKET}/ at {s3.endpoint_url}" in up.stdout
    assert (
        f"CommandError: uploads cannot be stored: the bucket '{BUCKET}' (STORAGE_S3_BUCKET) at {s3.endpoint_url} "
        "refuses these credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or the role's policy); "
        "everything was stopped"
    ) in up.stderr
