"""Upstream keys at rest: Fernet round trips, key rotation with ``upstream_keys_reencrypt``,
and clear errors for a key nobody can read any more."""

from __future__ import annotations

from io import StringIO

import pytest
from cryptography.fernet import Fernet
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.test import override_settings

from inference import secrets
from inference.models import Provider, UpstreamKey

OLD = Fernet.generate_key().decode()
NEW = Fernet.generate_key().decode()
OTHER = Fernet.generate_key().decode()


def keys(*encryption_keys: str):
    return override_settings(UPSTREAM_KEY_ENCRYPTION_KEYS=list(encryption_keys))


def test_round_trip_with_a_configured_key_and_with_the_key_derived_from_secret_key():
    for configured in ([OLD], []):
        with keys(*configured):
            token = secrets.encrypt("sk-live-123456")
            assert "sk-live" not in token and "123456" not in token
            assert secrets.encrypt("sk-live-123456") != token  # a fresh IV each time
            assert secrets.decrypt(token) == "sk-live-123456"


def test_a_key_encrypted_under_another_key_is_unreadable_with_a_clear_message():
    with keys(OLD):
        token = secrets.encrypt("sk-live-123456")
    with keys(OTHER), pytest.raises(secrets.SecretUnreadable) as caught:
        secrets.decrypt(token)
    message = str(caught.value)
    assert "cannot be decrypted with UPSTREAM_KEY_ENCRYPTION_KEYS" in message
    assert "the encryption key it was stored with is no longer configured" in message
    assert "sk-live" not in message
    with keys(OTHER), pytest.raises(secrets.SecretUnreadable, match="none of UPSTREAM_KEY_ENCRYPTION_KEYS"):
        secrets.reencrypt(token)


def test_a_malformed_encryption_key_names_its_position():
    with keys(OLD, "not-a-fernet-key"), pytest.raises(ImproperlyConfigured, match="item 2 is not a Fernet key"):
        secrets.encrypt("x")


@pytest.fixture
def stored_keys(db):
    provider = Provider.objects.create(name="up", kind="openai-compatible", base_url="http://localhost/v1", model="m")
    stored = []
    with keys(OLD):
        for label, secret in (("a", "sk-aaaa-1111"), ("b", "sk-bbbb-2222")):
            key = UpstreamKey(provider=provider, label=label)
            key.set_secret(secret)
            key.save()
            stored.append(key)
    return stored


def reencrypt() -> str:
    out = StringIO()
    call_command("upstream_keys_reencrypt", stdout=out)
    return out.getvalue()


def test_rotation_new_key_first_reencrypt_then_drop_the_old_key(stored_keys):
    # 1. A new key goes first, the old one stays after it: stored keys still decrypt.
    with keys(NEW, OLD):
        assert [key.secret() for key in UpstreamKey.objects.order_by("label")] == ["sk-aaaa-1111", "sk-bbbb-2222"]
        before = dict(UpstreamKey.objects.values_list("pk", "secret_encrypted"))
        # 2. The command moves every stored key to the new key.
        assert reencrypt() == "re-encrypted 2 upstream keys\n"
    after = dict(UpstreamKey.objects.values_list("pk", "secret_encrypted"))
    assert all(after[pk] != before[pk] for pk in before)
    # 3. The old key removed: everything still decrypts, and the old key alone reads nothing.
    with keys(NEW):
        assert [key.secret() for key in UpstreamKey.objects.order_by("label")] == ["sk-aaaa-1111", "sk-bbbb-2222"]
    with keys(OLD), pytest.raises(secrets.SecretUnreadable):
        UpstreamKey.objects.first().secret()
    # Fingerprints and last four are untouched.
    assert sorted(UpstreamKey.objects.values_list("last_four", flat=True)) == ["1111", "2222"]


def test_reencrypt_dry_run_changes_nothing(stored_keys):
    before = dict(UpstreamKey.objects.values_list("pk", "secret_encrypted"))
    out = StringIO()
    with keys(NEW, OLD):
        call_command("upstream_keys_reencrypt", "--dry-run", stdout=out)
    assert out.getvalue() == "would re-encrypt 2 upstream keys\n"
    assert dict(UpstreamKey.objects.values_list("pk", "secret_encrypted")) == before


def test_reencrypt_lists_the_keys_it_cannot_read_and_fails(stored_keys):
    with keys(OTHER):
        unreadable = UpstreamKey(provider=stored_keys[0].provider, label="lost")
        unreadable.set_secret("sk-cccc-3333")
        unreadable.save()
    out = StringIO()
    with keys(NEW, OLD), pytest.raises(CommandError) as caught:
        call_command("upstream_keys_reencrypt", stdout=out)
    assert out.getvalue() == "re-encrypted 2 upstream keys\n"
    assert str(caught.value) == (
        "1 upstream key could not be decrypted with any of UPSTREAM_KEY_ENCRYPTION_KEYS and was left unchanged "
        "(add the encryption key it was stored with, or enter it again in the admin): "
        f"up / lost (id {unreadable.pk}, …3333)"
    )
    with keys(NEW):
        assert sorted(key.secret() for key in UpstreamKey.objects.exclude(pk=unreadable.pk)) == [
            "sk-aaaa-1111",
            "sk-bbbb-2222",
        ]
