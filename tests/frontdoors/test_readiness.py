"""/healthz is liveness only; /readyz reports the database, Redis, a worker for each queue,
and each enabled GPU pool's devices (ready with at least one engine server answering)."""

import pytest
from django.utils import timezone

from frontdoors.readiness import readiness_summary
from inference.models import Provider
from inference.pool import device_health
from tests.inference.test_pool_selection import closed_device, engine_serving
from tests.inference.tiny_models import tiny_model_save

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def engine_device(tmp_path_factory) -> str:
    """A real engine server (our engine behind the OpenAI protocol): a device that answers /health."""
    folder = tmp_path_factory.mktemp("health-engine")
    with engine_serving(tiny_model_save(folder / "model", 1), folder / "engine.log") as url:
        yield url


def pool_make(name: str, *devices: str, enabled: bool = True) -> Provider:
    return Provider.objects.create(
        name=name, kind=Provider.Kind.LOCAL, devices=list(devices), model="tiny-pool", enabled=enabled
    )


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
    assert body["checks"]["pools"] == {}


def test_a_pool_whose_device_does_not_answer_is_not_ready_and_named(engine_device):
    closed = closed_device()
    reason = device_health(closed)
    assert reason.startswith("ConnectError")
    pool_make("dark-pool", closed)
    pool_make("half-pool", engine_device, closed)
    pool_make("lit-pool", engine_device)
    pool_make("off-pool", closed, enabled=False)
    Provider.objects.create(name="upstream", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url=closed, model="tiny-pool")

    pools = readiness_summary()["checks"]["pools"]

    # A disabled pool and an upstream are not pools to wait for.
    assert list(pools) == ["dark-pool", "half-pool", "lit-pool"]
    assert pools["dark-pool"] == {
        "ok": False,
        "state": "not ready",
        "devices": {closed: {"ok": False, "error": reason}},
        "not_ready": f"device not ready: {closed} ({reason})",
    }
    # One device answering is enough to serve; the other is still named.
    assert pools["half-pool"] == {
        "ok": True,
        "state": "ready",
        "devices": {engine_device: {"ok": True}, closed: {"ok": False, "error": reason}},
        "not_ready": f"device not ready: {closed} ({reason})",
    }
    assert pools["lit-pool"] == {"ok": True, "state": "ready", "devices": {engine_device: {"ok": True}}}


def test_every_device_not_ready_is_named(engine_device):
    first, second = closed_device(), closed_device()
    pool_make("dark-pool", first, second)
    [entry] = readiness_summary()["checks"]["pools"].values()
    assert entry["ok"] is False
    assert entry["not_ready"] == (
        f"devices not ready: {first} ({device_health(first)}); {second} ({device_health(second)})"
    )


def test_readyz_follows_the_workers_and_the_pools(client, start_worker, engine_device):
    with (
        start_worker(["ingest", "default"]) as cpu_worker,
        start_worker(["gpu"], pool="threads", concurrency=4) as gpu_worker,
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
        assert body["checks"]["pools"] == {}

        # An enabled pool none of whose devices answers: not ready, for that reason alone.
        closed = closed_device()
        dark = pool_make("dark-pool", closed)
        pooled = client.get("/readyz")
        assert pooled.status_code == 503
        body = pooled.json()
        assert body["status"] == "not ready"
        assert all(entry["ok"] for entry in body["checks"]["queues"].values())
        assert body["checks"]["pools"] == {
            "dark-pool": {
                "ok": False,
                "state": "not ready",
                "devices": {closed: {"ok": False, "error": device_health(closed)}},
                "not_ready": f"device not ready: {closed} ({device_health(closed)})",
            }
        }
        # Warming (manage.py up starting its servers): shown as such, and the system is ready
        # without it, since answers are extractive meanwhile.
        Provider.objects.filter(pk=dark.pk).update(warming_since=timezone.now())
        warming = client.get("/readyz")
        assert warming.status_code == 200, warming.json()
        entry = warming.json()["checks"]["pools"]["dark-pool"]
        assert (entry["ok"], entry["state"], entry["warming_since"]) == (
            False,
            "warming",
            Provider.objects.get(pk=dark.pk).warming_since.isoformat(),
        )
        assert entry["note"] == "the engine servers are starting; answers are extractive until the pool is ready"
        Provider.objects.filter(pk=dark.pk).update(warming_since=None)
        # A device comes up: ready, the other still named.
        Provider.objects.filter(pk=dark.pk).update(devices=[closed, engine_device])
        lit = client.get("/readyz")
        assert lit.status_code == 200, lit.json()
        assert lit.json()["checks"]["pools"]["dark-pool"]["ok"] is True
        # Disabled, it is not waited for.
        Provider.objects.filter(pk=dark.pk).update(devices=[closed], enabled=False)
        unlisted = client.get("/readyz")
        assert unlisted.status_code == 200 and unlisted.json()["checks"]["pools"] == {}

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


def test_the_admin_signs_in_on_the_sites_sign_in_page(client):
    response = client.get("/admin/login/", {"next": "/admin/"}, follow=True)
    assert response.redirect_chain == [("/accounts/login/?next=%2Fadmin%2F", 302)]
    assert b'name="username"' in response.content and b'name="next" value="/admin/"' in response.content
