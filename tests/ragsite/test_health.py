"""/healthz is liveness only; /readyz reports the database, Redis and a worker for each queue."""

import pytest

pytestmark = pytest.mark.django_db(transaction=True)


def test_healthz_answers_without_touching_dependencies(client, django_assert_num_queries):
    with django_assert_num_queries(0):
        response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    assert "no-cache" in response["Cache-Control"]


def test_readyz_is_not_ready_without_workers(client):
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "not ready"
    assert body["checks"]["database"]["ok"] is True
    assert body["checks"]["redis"]["ok"] is True
    assert body["checks"]["queues"] == {
        "ingest": {"ok": False, "workers": []},
        "gpu": {"ok": False, "workers": []},
        "remote": {"ok": False, "workers": []},
        "default": {"ok": False, "workers": []},
    }


def test_readyz_follows_the_workers(client, start_worker):
    with (
        start_worker(["ingest", "default"]) as cpu_worker,
        start_worker(["gpu"]) as gpu_worker,
        start_worker(["remote"], pool="threads", concurrency=2) as remote_worker,
    ):
        ready = client.get("/readyz")
        assert ready.status_code == 200, ready.json()
        body = ready.json()
        assert body["status"] == "ready"
        assert body["checks"]["database"]["pgvector"].startswith("0.")
        assert body["checks"]["queues"] == {
            "ingest": {"ok": True, "workers": [cpu_worker.name]},
            "gpu": {"ok": True, "workers": [gpu_worker.name]},
            "remote": {"ok": True, "workers": [remote_worker.name]},
            "default": {"ok": True, "workers": [cpu_worker.name]},
        }
        assert gpu_worker.stop() == 0

        degraded = client.get("/readyz")
        assert degraded.status_code == 503
        queues = degraded.json()["checks"]["queues"]
        assert queues["gpu"] == {"ok": False, "workers": []}
        assert queues["ingest"] == {"ok": True, "workers": [cpu_worker.name]}


def test_readyz_reports_an_unreachable_database(client, settings, monkeypatch):
    from django.db import connection

    def broken_cursor(*args, **kwargs):
        raise connection.Database.OperationalError("connection refused")

    monkeypatch.setattr(connection, "cursor", broken_cursor)
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["database"] == {"ok": False, "error": "OperationalError: connection refused"}


def test_admin_login_page_renders(client):
    response = client.get("/admin/login/")
    assert response.status_code == 200
    assert b'name="username"' in response.content
    assert b"RAG search administration" in response.content
