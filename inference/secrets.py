"""Upstream API keys at rest: Fernet (AES-128-CBC + HMAC-SHA256, from ``cryptography``).

The encryption keys come from ``UPSTREAM_KEY_ENCRYPTION_KEYS`` (comma-separated Fernet
keys; the first encrypts, all decrypt, so an operator rotates by putting a new key first
and running ``manage.py upstream_keys_reencrypt``). Unset, one key is derived from
``SECRET_KEY`` with HKDF, so the embedded install works with nothing configured; rotating
``SECRET_KEY`` then needs the old one listed explicitly (docs/operations.md).
"""

from __future__ import annotations

import base64
import functools
import hashlib

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


class SecretUnreadable(Exception):
    """A stored key that none of the configured encryption keys can decrypt."""


def derived_key(secret_key: str) -> bytes:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"ragsite-upstream-keys", info=b"fernet-v1")
    return base64.urlsafe_b64encode(hkdf.derive(secret_key.encode()))


@functools.cache
def _fernet(keys: tuple[str, ...], secret_key: str) -> MultiFernet:
    if not keys:
        return MultiFernet([Fernet(derived_key(secret_key))])
    fernets = []
    for index, key in enumerate(keys):
        try:
            fernets.append(Fernet(key.encode()))
        except ValueError:
            raise ImproperlyConfigured(
                f"UPSTREAM_KEY_ENCRYPTION_KEYS item {index + 1} is not a Fernet key (32 url-safe base64 bytes; make "
                "one with: python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())')"
            ) from None
    return MultiFernet(fernets)


def fernet() -> MultiFernet:
    return _fernet(tuple(settings.UPSTREAM_KEY_ENCRYPTION_KEYS), settings.SECRET_KEY)


def encrypt(plaintext: str) -> str:
    return fernet().encrypt(plaintext.encode()).decode()


def decrypt(token: str) -> str:
    try:
        return fernet().decrypt(token.encode()).decode()
    except InvalidToken:
        raise SecretUnreadable(
            "an upstream key cannot be decrypted with UPSTREAM_KEY_ENCRYPTION_KEYS (or the key derived from "
            "SECRET_KEY): the encryption key it was stored with is no longer configured"
        ) from None


def reencrypt(token: str) -> str:
    """The same secret under the first (newest) encryption key."""
    try:
        return fernet().rotate(token.encode()).decode()
    except InvalidToken:
        raise SecretUnreadable(
            "an upstream key cannot be re-encrypted: none of UPSTREAM_KEY_ENCRYPTION_KEYS (or the key derived from "
            "SECRET_KEY) decrypts it; list the key it was stored with after the new one and run the command again"
        ) from None


def fingerprint(plaintext: str) -> str:
    # API keys are long random strings, so a plain SHA-256 reveals nothing useful.
    return hashlib.sha256(plaintext.encode()).hexdigest()
