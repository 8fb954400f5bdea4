"""The system set up as on several machines, every service a real process: PostgreSQL behind
PgBouncer in transaction mode (``DATABASE_TRANSACTION_POOLING``) with the ranking and reports
on a replica URL whose sessions refuse writes; Redis by role, the broker found through a
Sentinel and each role on a database of its own, none on ``REDIS_URL``'s; uploads on an S3
server. A uvicorn web process and two Celery workers: a multipart upload ingested by a worker
in another process, search in each mode, an answer generated under a key's request limit,
streamed and billed, the original file downloaded back, and the admin (its sign-in, a list,
the audit log's CSV export, which reads with ``iterator()``)."""

from __future__ import annotations

import csv
import io
import time
import urllib.request
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection

from billing import client_keys
from billing.models import UsageRecord
from search.models import Document
from search.services import collection_create, workspace_create
from tests.conftest import database_url_for_current_test_db, web_server
from tests.frontdoors.api.conftest import DOCUMENTS
from tests.frontdoors.api.test_live import call, read_events, stand_in_route, upload_and_wait_indexed
from tests.pgbouncer import REPLICA, PgBouncer
from tests.s3_server import BUCKET, S3Server
from tests.sentinel import MASTER, Sentinel
from tests.upstream_server import upstream_log

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PASSWORD = "correct horse battery staple"
# A database of the test Redis per role, and one for REDIS_URL that must stay empty.
REDIS_DATABASES = {
    "REDIS_URL": 10,
    "broker": 11,
    "REDIS_STREAMS_URL": 12,
    "REDIS_CACHE_URL": 13,
    "REDIS_LIMITS_URL": 14,
}


@pytest.fixture(scope="module")
def services(django_db_setup, django_db_blocker, tmp_path_factory):
    with django_db_blocker.unblock():
        params = connection.get_connection_params()
    started = []
    try:
        bouncer = PgBouncer(params["host"], int(params.get("port") or 5432), replica_of=params["dbname"])
        started.append(bouncer)
        s3 = S3Server(tmp_path_factory.mktemp("s3"))
        started.append(s3)
        sentinel = Sentinel(tmp_path_factory.mktemp("sentinel"), settings.REDIS_URL)
        started.append(sentinel)
        yield bouncer, s3, sentinel
    finally:
        for service in reversed(started):
            service.stop()


def redis_database(number: int) -> redis.Redis:
    return redis.Redis.from_url(urlunsplit(urlsplit(settings.REDIS_URL)._replace(path=f"/{number}")))


def redis_keys(number: int) -> list[str]:
    return sorted(key.decode() for key in redis_database(number).scan_iter(count=1000))


def csrf(browser: httpx.Client) -> str:
    return browser.cookies["csrftoken"]


def test_upload_search_answers_and_the_admin_with_every_service_apart(
    services, start_worker, upstream_server, tmp_path
):
    bouncer, s3, sentinel = services
    database = connection.settings_dict["NAME"]
    for number in REDIS_DATABASES.values():
        redis_database(number).flushdb()
    env = {
        "DATABASE_URL": bouncer.url(database),
        "DATABASE_TRANSACTION_POOLING": "true",
        "DATABASE_REPLICA_URL": bouncer.url(REPLICA),
        "DATABASE_DIRECT_URL": database_url_for_current_test_db(),
        "REDIS_BROKER_URL": sentinel.url(REDIS_DATABASES["broker"]),
        "REDIS_SENTINEL_MASTER": MASTER,
        **s3.env(),
        "MEDIA_ROOT": str(tmp_path / "media"),
    }
    for name in ("REDIS_URL", "REDIS_STREAMS_URL", "REDIS_CACHE_URL", "REDIS_LIMITS_URL"):
        env[name] = urlunsplit(urlsplit(settings.REDIS_URL)._replace(path=f"/{REDIS_DATABASES[name]}"))

    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Handbook")
    key, token = client_keys.client_key_create(workspace, "apart", scopes=["admin"], requests_per_minute=100)
    get_user_model().objects.create_superuser("ops", "ops@example.com", PASSWORD)
    api_key = stand_in_route(upstream_server, "apart", steps=[{"token_delay_ms": 10}])
    reply = "The robot runs for 10 hours on one charge [1]."
    before, replica_before = bouncer.transactions(database), bouncer.transactions(REPLICA)

    with (
        web_server(tmp_path, env=env) as base,
        start_worker(["ingest", "default"], env=env) as ingest_worker,
        start_worker(["remote"], pool="threads", concurrency=2, env=env) as remote_worker,
    ):
        upload_and_wait_indexed(base, token, collection.pk)

        for mode in ("dense", "keyword", "hybrid"):
            status, _, found = call("POST", f"{base}/api/v1/search", token, {"query": "battery charge", "mode": mode})
            assert status == 200, found
            assert found["results"][0]["document_title"] == "Atlas-7 robot", (mode, found["results"])

        status, _, answer = call(
            "POST", f"{base}/api/v1/answers", token, {"question": f"How long does the robot run?\nREPLY: {reply}"}
        )
        assert (status, answer["status"]) == (202, "generating"), answer
        events = read_events(answer["stream_url"] + "?unverified=true", token)
        assert "".join(data["text"] for _, kind, _, data in events if kind == "delta") == reply
        assert (events[-1][1], events[-1][3]["text"], events[-1][3]["grounded"]) == ("answer", reply, 1.0)
        deadline = time.monotonic() + 60
        while not UsageRecord.objects.filter(client_key=key).exists():
            assert time.monotonic() < deadline, "the answer was not billed"
            time.sleep(0.2)

        robot = Document.objects.get(source_name="robot.md")
        request = urllib.request.Request(
            f"{base}/api/v1/documents/{robot.pk}/file", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.read() == DOCUMENTS["robot.md"].encode()
        ready = call("GET", f"{base}/readyz", token)[2]  # 503: no gpu worker here; the services are checked

        with httpx.Client(base_url=base, timeout=30, follow_redirects=True) as browser:
            sign_in = browser.get("/admin/")
            assert sign_in.url.path == "/accounts/login/"
            signed_in = browser.post(
                str(sign_in.url),
                data={"username": "ops", "password": PASSWORD, "csrfmiddlewaretoken": csrf(browser)},
                headers={"Referer": str(sign_in.url)},
            )
            assert (signed_in.status_code, signed_in.url.path) == (200, "/admin/")
            documents = browser.get("/admin/search/document/")
            assert documents.status_code == 200 and "Atlas-7 robot" in documents.text
            events_page = browser.get("/admin/ragsite/auditevent/")
            ids = [value.split('"')[0] for value in events_page.text.split('name="_selected_action" value="')[1:]]
            assert ids, events_page.text[:2000]
            exported = browser.post(
                "/admin/ragsite/auditevent/",
                data={"action": "export_csv", "_selected_action": ids, "csrfmiddlewaretoken": csrf(browser)},
                headers={"Referer": f"{base}/admin/ragsite/auditevent/"},
            )
            assert exported.status_code == 200 and exported.headers["Content-Type"] == "text/csv; charset=utf-8"
            rows = list(csv.DictReader(io.StringIO(exported.text.lstrip("\ufeff"))))
            assert len(rows) == len(ids)
            actions = [row["action"] for row in rows]
            assert (actions.count("search"), actions.count("ask"), actions.count("sign_in")) == (3, 1, 1), actions
        found_keys = {name: redis_keys(number) for name, number in REDIS_DATABASES.items()}
        logs = "".join(process.log() for process in (ingest_worker, remote_worker))
    logs += "".join(path.read_text(errors="replace") for path in tmp_path.glob("web-*.log"))

    assert len(upstream_log(upstream_server, api_key)) == 1
    # PostgreSQL: every process's connections through the pooler, the ranking through the replica's.
    assert bouncer.transactions(database) - before > 50
    assert bouncer.transactions(REPLICA) - replica_before >= 3
    for failure in ("prepared statement", "does not exist", "read-only transaction", "Traceback"):
        assert failure not in logs, failure
    assert "ERROR" not in bouncer.log(), bouncer.log()[-3000:]
    # Redis: each role's keys on its own database; the broker's reached through the sentinel.
    assert found_keys["REDIS_URL"] == []
    streams = found_keys["REDIS_STREAMS_URL"]
    # The answer's token stream, and the ledger's outbox written with its last event.
    assert len(streams) == 2 and streams[0].startswith("gen:") and streams[1] == "ledger:outbox", streams
    limits = found_keys["REDIS_LIMITS_URL"]
    assert limits and all(name.startswith(f"limits:{{{key.pk}}}:") for name in limits), limits
    cached = found_keys["REDIS_CACHE_URL"]
    assert cached and all(name.startswith("ragsite:") for name in cached), cached  # the query's embedding
    broker = found_keys["broker"]
    assert "_kombu.binding.default" in broker and any(name.startswith("celery-task-meta-") for name in broker), broker
    assert not any(name.startswith(("gen:", "ledger:", "limits:", "ragsite:")) for name in broker), broker
    assert ready["checks"]["redis"]["ok"] is True
    # S3: the uploads in the bucket under the documents' names, none on the local disk.
    names = sorted(document.file.name for document in Document.objects.all())
    assert len(names) == 2 and all(name.startswith("documents/") for name in names)
    assert s3.keys() == names
    local = tmp_path / "media"
    assert not local.exists() or not any(path.is_file() for path in local.rglob("*"))
    storage = ready["checks"]["storage"]
    assert (storage["ok"], storage["where"]) == (True, f"s3://{BUCKET}/ at {s3.endpoint_url}"), storage
