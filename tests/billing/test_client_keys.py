"""Client API keys (billing/client_keys.py, the admin): shown once, stored only as a hash,
checked in constant time, refused with the APIs' error shape when bad, expired, revoked or
without the scope, and their use recorded at most once a minute."""

from __future__ import annotations

import hashlib
import json
import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import RequestFactory
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing import client_keys
from billing.client_keys import ClientKeyError
from billing.models import ClientKey
from search.models import Workspace

pytestmark = pytest.mark.django_db


@pytest.fixture
def workspace():
    return Workspace.objects.create(name="Acme", slug="acme")


def test_a_key_is_shown_once_and_only_its_hash_prefix_and_last_four_are_stored(workspace):
    key, token = client_keys.client_key_create(workspace, "ci", scopes=["search", "generate"])

    assert re.fullmatch(r"rk_[A-Za-z0-9]{8}_[A-Za-z0-9_-]{43}", token)
    assert (key.prefix, key.last_four) == (token[3:11], token[-4:])
    assert key.secret_hash == hashlib.sha256(token.encode()).hexdigest()
    secret = token[12:]
    # Checked on the table itself: no column holds the key or its secret part.
    with connection.cursor() as cursor:
        cursor.execute("SELECT row_to_json(k)::text FROM billing_clientkey k WHERE id = %s", [key.id])
        (stored,) = cursor.fetchone()
    assert token not in stored and secret not in stored and secret[:16] not in stored
    assert json.loads(stored)["secret_hash"] == key.secret_hash
    assert str(key) == f"ci (rk_{key.prefix}_…{token[-4:]})"


def test_a_valid_key_authenticates_and_is_compared_in_constant_time(workspace, monkeypatch):
    key, token = client_keys.client_key_create(workspace, "ci", scopes=["search"])
    compared = []
    real = client_keys.hmac.compare_digest

    def recording(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(client_keys.hmac, "compare_digest", recording)

    assert client_keys.client_key_authenticate(token, scope="search") == key
    assert compared == [(key.secret_hash, key.secret_hash)]
    # A wrong secret with the right prefix, and an unknown prefix: both compared, both refused alike.
    wrong = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    unknown = "rk_zzzzzzzz_" + token[12:]
    for bad in (wrong, unknown):
        with pytest.raises(ClientKeyError) as refused:
            client_keys.client_key_authenticate(bad)
        assert (refused.value.code, refused.value.status) == ("invalid_api_key", 401)
    assert len(compared) == 3


@pytest.mark.parametrize(
    ("token", "code"),
    [
        (None, "missing_api_key"),
        ("", "missing_api_key"),
        ("sk-not-ours", "invalid_api_key"),
        ("rk_short_x", "invalid_api_key"),
    ],
)
def test_missing_and_malformed_keys_are_refused(token, code):
    with pytest.raises(ClientKeyError) as refused:
        client_keys.client_key_authenticate(token)
    assert (refused.value.code, refused.value.status) == (code, 401)


def test_expired_revoked_and_out_of_scope_keys_are_refused_with_the_reason(workspace):
    now = timezone.now()
    expired, expired_token = client_keys.client_key_create(workspace, "old", scopes=["search"], expires_at=now)
    revoked, revoked_token = client_keys.client_key_create(workspace, "gone", scopes=["search"])
    client_keys.client_key_revoke(revoked, reason="leaked in a log")
    _, reader_token = client_keys.client_key_create(workspace, "reader", scopes=["search"])
    admin_key, admin_token = client_keys.client_key_create(workspace, "ops", scopes=["admin"])

    with pytest.raises(ClientKeyError) as refused:
        client_keys.client_key_authenticate(expired_token, now=now)
    assert (refused.value.code, refused.value.status) == ("expired_api_key", 401)
    assert client_keys.client_key_authenticate(expired_token, now=now - timedelta(seconds=1)) == expired

    with pytest.raises(ClientKeyError) as refused:
        client_keys.client_key_authenticate(revoked_token)
    assert (refused.value.code, refused.value.status) == ("revoked_api_key", 401)
    revoked.refresh_from_db()
    assert revoked.revoked_reason == "leaked in a log"

    with pytest.raises(ClientKeyError) as refused:
        client_keys.client_key_authenticate(reader_token, scope="generate")
    assert (refused.value.code, refused.value.status) == ("insufficient_scope", 403)
    assert "'generate'" in refused.value.message and "search" in refused.value.message
    assert client_keys.client_key_authenticate(admin_token, scope="generate") == admin_key  # admin has every scope


def test_a_bearer_token_that_is_no_key_is_refused_saying_so(workspace):
    request = RequestFactory().get("/api/v1/usage", HTTP_AUTHORIZATION="Bearer rk_nope")
    token = client_keys.bearer_token(request)
    assert token == "rk_nope"
    with pytest.raises(ClientKeyError) as refused:
        client_keys.client_key_authenticate(token)
    assert (refused.value.status, refused.value.code, refused.value.message) == (
        401,
        "invalid_api_key",
        "The API key is not valid: check that it was copied whole.",
    )
    assert client_keys.bearer_token(RequestFactory().get("/", HTTP_AUTHORIZATION="Basic abc")) is None


def test_last_used_is_written_at_most_once_a_minute(workspace):
    key, token = client_keys.client_key_create(workspace, "ci")
    start = timezone.now()

    with CaptureQueriesContext(connection) as first:
        client_keys.client_key_authenticate(token, now=start)
    with CaptureQueriesContext(connection) as again:
        client_keys.client_key_authenticate(token, now=start + timedelta(seconds=59))
    client_keys.client_key_authenticate(token, now=start + timedelta(seconds=61))

    # The key's statement is prepared (ragsite.rows), and Django's log has no text for a
    # prepared execution: the statements are counted, and the UPDATE named.
    assert len(first.captured_queries) == 2 and first.captured_queries[1]["sql"].startswith("UPDATE")
    assert len(again.captured_queries) == 1 and not (again.captured_queries[0]["sql"] or "").startswith("UPDATE")
    key.refresh_from_db()
    assert key.last_used_at == start + timedelta(seconds=61)


def test_unknown_scopes_are_refused_at_creation(workspace):
    with pytest.raises(ValueError, match="unknown scope"):
        client_keys.client_key_create(workspace, "ci", scopes=["search", "everything"])


def test_the_admin_shows_a_new_key_once_and_then_only_masked(workspace, client):
    staff = get_user_model().objects.create_superuser("ops", "ops@example.com", "pw-for-tests")
    client.force_login(staff)

    created = client.post(
        "/admin/billing/clientkey/add/",
        {"workspace": workspace.id, "name": "integration", "scopes": ["search", "generate"]},
    )

    assert created.status_code == 200
    assert "no-store" in created["Cache-Control"]
    token = re.search(r'value="(rk_[^"]+)"', created.content.decode()).group(1)
    key = ClientKey.objects.get(name="integration")
    assert (key.scopes, key.created_by) == (["search", "generate"], staff)
    assert client_keys.client_key_authenticate(token, scope="generate") == key
    listing = client.get("/admin/billing/clientkey/").content.decode()
    assert key.masked in listing and token not in listing and token[12:30] not in listing
    detail = client.get(f"/admin/billing/clientkey/{key.id}/change/").content.decode()
    assert token not in detail and key.secret_hash not in detail

    client.post(
        "/admin/billing/clientkey/",
        {"action": "revoke_keys", "_selected_action": [key.id]},
    )
    with pytest.raises(ClientKeyError, match="revoked"):
        client_keys.client_key_authenticate(token)
