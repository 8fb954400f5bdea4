"""Secrets at rest, in logs and on pages.

An operator enters two upstream keys through the admin form; a developer's client key answers
through the REST API and the OpenAI-compatible endpoint, served by a remote worker over the
stand-in, where the first key is refused with a 401 whose message echoes it (some proxies do)
and the request fails over to a route with the second key. Then every table of the database
is read raw (each row as text), every Redis key's value is read, and the web and worker logs
(at DEBUG) are searched: neither upstream key, nor the client key, nor the secret part of
either appears anywhere. Upstream keys are stored encrypted (Fernet), client keys as a
SHA-256 hash with a prefix and their last four characters.
"""

from __future__ import annotations

import base64
import time

import openai
import pytest
import requests
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client

from billing import client_keys, ledger
from billing.models import UsageRecord
from inference.models import Provider, Route, RouteFallback, UpstreamKey
from ragsite.redis import Role, redis_client
from search.services import collection_create, workspace_create
from tests.inference.routing_helpers import unique
from tests.search.files import ingest_texts
from tests.upstream_server import upstream_log, upstream_script

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

GOOD_SECRET = "sk-live-good-" + "7Qm2xVb9" * 4
REVOKED_SECRET = "sk-live-revoked-" + "Zp4LkW8n" * 4
REPLY = "The Atlas-7 robot runs for 10 hours on one charge [1]."


def secret_forms(secret: str) -> set[str]:
    """The secret as it could leak: itself, its body without the prefix, base64 of either. A
    client key's body is what follows ``rk_<prefix>_``: URL-safe base64 has ``_`` in its
    alphabet, so the body's own last ``_`` must not cut it (its tail could be the last four
    characters the key's row keeps on purpose)."""
    forms = {secret, secret.split("_", 2)[2] if secret.startswith("rk_") else secret[8:]}
    return forms | {base64.b64encode(form.encode()).decode() for form in forms}


def database_text() -> dict[str, str]:
    """Every row of every table in the public schema, as PostgreSQL's text form of the row."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        tables = [name for (name,) in cursor.fetchall()]
        text = {}
        for table in tables:
            cursor.execute(f"SELECT string_agg(t::text, E'\\n') FROM \"{table}\" t")  # noqa: S608 (catalog names)
            text[table] = cursor.fetchone()[0] or ""
    return text


def redis_text() -> dict[str, str]:
    client = redis_client(Role.BROKER)
    text = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        if kind == "string":
            value = client.get(key)
        elif kind == "list":
            value = b"\n".join(client.lrange(key, 0, -1))
        elif kind == "hash":
            value = b"\n".join(k + b"=" + v for k, v in client.hgetall(key).items())
        elif kind == "set":
            value = b"\n".join(client.smembers(key))
        elif kind == "zset":
            value = b"\n".join(client.zrange(key, 0, -1))
        elif kind == "stream":
            value = b"\n".join(repr(fields).encode() for _, fields in client.xrange(key))
        else:
            value = b""
        text[key.decode(errors="replace")] = (value or b"").decode(errors="replace")
    return text


def leaks(texts: dict[str, str], secrets: dict[str, str]) -> list[str]:
    return [
        f"{name} in {where}"
        for name, secret in secrets.items()
        for form in secret_forms(secret)
        for where, text in texts.items()
        if form in text
    ]


def generations(workspace):
    """The generation rows of this test's workspace. The ledger's outbox lives in Redis, which
    outlives each test's database: rows that earlier tests queued and never drained are stored
    by this test's drains too (with no workspace: theirs is gone), and must not count here."""
    return UsageRecord.objects.filter(kind=UsageRecord.Kind.GENERATION, workspace=workspace).order_by("id")


def test_no_secret_is_stored_logged_or_shown(start_web, start_worker, upstream_server, tmp_path):
    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Handbook")
    ingest_texts(collection, {"robot.md": "# Atlas-7 robot\n\nThe Atlas-7 robot runs for 10 hours on one charge."})
    _, token = client_keys.client_key_create(workspace, "integration", scopes=["search", "generate"])

    # The operator enters both upstream keys in the admin, as a person would.
    operator = get_user_model().objects.create_superuser("ops", password="operator password 1")
    admin = Client()
    admin.force_login(operator)
    failing = Provider.objects.create(
        name=unique("primary"), kind=Provider.Kind.OPENAI_COMPATIBLE, base_url=upstream_server, model="stand-in-7b"
    )
    working = Provider.objects.create(
        name=unique("fallback"), kind=Provider.Kind.OPENAI_COMPATIBLE, base_url=upstream_server, model="stand-in-7b"
    )
    for provider, secret in ((failing, REVOKED_SECRET), (working, GOOD_SECRET)):
        response = admin.post(
            "/admin/inference/upstreamkey/add/", {"provider": provider.pk, "label": "main", "secret": secret}
        )
        assert response.status_code == 302, response.content.decode()[:2000]
    revoked = UpstreamKey.objects.get(provider=failing)
    upstream_script(upstream_server, REVOKED_SECRET, [{"status": 401, "repeat": True}])
    fallback = Route.objects.create(name=unique("fallback"), provider=working, max_tokens=64)
    primary = Route.objects.create(name=unique("primary"), provider=failing, max_tokens=64, is_default=True)
    RouteFallback.objects.create(route=primary, fallback=fallback, position=0)

    debug = {"LOG_LEVEL": "DEBUG"}
    with (
        start_worker(["remote"], pool="threads", concurrency=2, env=debug) as remote,
        start_worker(["default"], env=debug) as default,
        start_web(env=debug) as base_url,
    ):
        bearer = {"Authorization": f"Bearer {token}"}
        answer = requests.post(
            f"{base_url}/api/v1/answers?wait=60",
            json={"question": f"How long does the robot run?\nREPLY: {REPLY}"},
            headers=bearer,
            timeout=90,
        ).json()
        assert (answer["status"], answer["text"]) == ("done", REPLY)
        chat = openai.OpenAI(base_url=f"{base_url}/v1", api_key=token).chat.completions.create(
            model=fallback.name, messages=[{"role": "user", "content": f"Robot?\nREPLY: {REPLY}"}]
        )
        assert chat.choices[0].message.content == REPLY
        # A mistyped key is refused, and neither it nor the real one is echoed.
        typo = token[:-1] + ("x" if token[-1] != "x" else "y")
        refused = requests.get(f"{base_url}/api/v1/usage", headers={"Authorization": f"Bearer {typo}"}, timeout=30)
        assert refused.status_code == 401 and typo not in refused.text and token not in refused.text
        ledger.usage_records_store()
        deadline = time.monotonic() + 60
        while generations(workspace).count() < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            ledger.usage_records_store()
        pages = {
            "key list": admin.get("/admin/inference/upstreamkey/").content.decode(),
            "key page": admin.get(f"/admin/inference/upstreamkey/{revoked.pk}/change/").content.decode(),
            "client keys": admin.get("/admin/billing/clientkey/").content.decode(),
        }
        logs = {"remote worker": remote.log(), "default worker": default.log()}
    logs |= {path.name: path.read_text(errors="replace") for path in tmp_path.glob("web-*.log")}

    # It ran as described: the revoked key was refused (its message echoed it) and disabled with a
    # reason that does not repeat it; the fallback's key served both requests.
    assert [entry["outcome"] for entry in upstream_log(upstream_server, REVOKED_SECRET)] == ["status 401"]
    assert len(upstream_log(upstream_server, GOOD_SECRET)) == 2
    revoked.refresh_from_db()
    assert revoked.status == UpstreamKey.Status.DISABLED
    assert "401" in revoked.last_error and REVOKED_SECRET not in revoked.last_error
    assert list(generations(workspace).values_list("client_key__name", "status")) == [("integration", "ok")] * 2
    assert GOOD_SECRET[-4:] in pages["key list"]  # the pages were read: they show the last four

    secrets = {"good upstream key": GOOD_SECRET, "revoked upstream key": REVOKED_SECRET, "client key": token}
    tables = database_text()
    assert token.split("_")[1] in tables["billing_clientkey"]  # the scan reads the keys' rows (their prefix)
    assert leaks(tables, secrets) == []
    assert leaks(redis_text(), secrets) == []
    assert leaks(pages, secrets) == []
    assert any("POST /api/v1/answers" in text for text in logs.values())  # the web log was read
    assert leaks(logs, secrets) == []
