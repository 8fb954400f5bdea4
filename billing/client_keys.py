"""Client API keys: made, shown once, checked, revoked.

A key reads ``rk_<prefix>_<secret>``: ``rk_`` says what it is (secret scanners and people
recognise it), the 8-character prefix is the lookup id, the secret is 32 random bytes
(URL-safe base64). Only the prefix, the SHA-256 of the whole key and its last four
characters are stored. SHA-256 rather than a slow password hash: the key has 256 bits of
entropy, so there is nothing to brute-force, and every API request checks one.

``client_key_authenticate`` finds the row by prefix, with its workspace, in one prepared
hand-written statement (``ragsite.rows``: every API request runs it, and the ORM's compilation
cost more than the round trip), and compares hashes with ``hmac.compare_digest`` (constant
time); an unknown prefix is compared against a dummy hash too, so both failures take the
same path. Every refusal is a ``ClientKeyError`` whose ``code`` and ``status`` the
APIs turn into their error shapes (frontdoors/api/errors.py, frontdoors/openai_api/errors.py):
401 for a missing, malformed, unknown, expired or revoked key, 403 for a key without the
scope. ``last_used_at`` is written at most once a minute per key (a conditional UPDATE,
sent only when the loaded value is older than that).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
import secrets
import string
from datetime import datetime, timedelta

from django.db.models import Q
from django.utils import timezone

from billing.models import ClientKey
from ragsite.audit import Action, audit_record
from ragsite.errors import DomainError
from ragsite.rows import Rows, fetch_one

KEY_PREFIX = "rk_"
_PREFIX_ALPHABET = string.ascii_letters + string.digits
_KEY_FORMAT = re.compile(r"^rk_([A-Za-z0-9]{8})_([A-Za-z0-9_-]{43})$")
LAST_USED_EVERY = timedelta(minutes=1)
# Compared against when the prefix is unknown, so that an unknown key costs what a wrong one does.
_DUMMY_HASH = hashlib.sha256(b"rk_00000000_" + b"0" * 43).hexdigest()


class ClientKeyError(DomainError):
    """A key that cannot be used: 401 when missing, unknown, expired or revoked; 403 when it lacks the scope."""

    status = 401

    def __init__(self, code: str, message: str, status: int = 401):
        super().__init__(message, code=code, status=status)


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def client_key_create(
    workspace,
    name: str,
    *,
    scopes: list[str] | tuple[str, ...] = (),
    expires_at: datetime | None = None,
    created_by=None,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
    monthly_budget_usd=None,
    acts_for_user=None,
    acts_for_group=None,
) -> tuple[ClientKey, str]:
    """A new key for ``workspace``: the row and the key itself, which is never stored and
    must be shown to its owner now, once. ``acts_for_user`` / ``acts_for_group``: whose
    documents it reads (search.access); neither: those open to the whole workspace."""
    unknown = sorted(set(scopes) - set(ClientKey.Scope.values))
    if unknown:
        raise ValueError(f"unknown scope(s) {', '.join(unknown)}; scopes are {', '.join(ClientKey.Scope.values)}")
    key = ClientKey(
        workspace=workspace,
        name=name,
        scopes=list(dict.fromkeys(scopes)),
        expires_at=expires_at,
        created_by=created_by,
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
        monthly_budget_usd=monthly_budget_usd,
        acts_for_user=acts_for_user,
        acts_for_group=acts_for_group,
    )
    if acts_for_user is not None and acts_for_group is not None:
        raise ValueError("a key acts for a user or for a group, not both")
    token = client_key_secret_issue(key)
    key.save()
    key_created_audit(key)
    return key, token


def key_created_audit(key: ClientKey, *, request=None) -> None:
    """The audit log's record of a new key: who made it, its scopes and whom it acts for."""
    audit_record(
        Action.KEY_CREATE,
        user=key.created_by,
        actor=None if key.created_by is not None else "operator",
        request=request,
        workspace_id=key.workspace_id,
        target=f"key:{key.pk}",
        detail={
            "name": key.name,
            "scopes": list(key.scopes),
            "acts_for_user": key.acts_for_user_id,
            "acts_for_group": key.acts_for_group_id,
        },
    )


def client_key_secret_issue(key: ClientKey) -> str:
    """Give an unsaved ``key`` its prefix, hash and last four; returns the key itself."""
    prefix = "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(8))
    while ClientKey.objects.filter(prefix=prefix).exists():  # 62^8 prefixes: practically never
        prefix = "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(8))
    token = f"{KEY_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
    key.prefix, key.secret_hash, key.last_four = prefix, _hash(token), token[-4:]
    return token


def client_key_authenticate(token: str | None, *, scope: str | None = None, now: datetime | None = None) -> ClientKey:
    """The key's row, if ``token`` is a valid, unexpired, unrevoked key with ``scope``;
    else ``ClientKeyError``. Records the use (at most once a minute)."""
    now = now or timezone.now()
    if not token:
        raise ClientKeyError(
            "missing_api_key", "No API key: send it as 'Authorization: Bearer rk_...' (create one in the admin)."
        )
    match = _KEY_FORMAT.match(token.strip())
    key = _key_with_workspace(match.group(1)) if match else None
    expected = key.secret_hash if key is not None else _DUMMY_HASH
    if not hmac.compare_digest(expected, _hash(token.strip())) or key is None:
        raise ClientKeyError("invalid_api_key", "The API key is not valid: check that it was copied whole.")
    if key.revoked_at is not None:
        raise ClientKeyError(
            "revoked_api_key", f"The API key {key.masked} was revoked on {key.revoked_at:%Y-%m-%d}: use another one."
        )
    if key.expires_at is not None and key.expires_at <= now:
        raise ClientKeyError(
            "expired_api_key", f"The API key {key.masked} expired on {key.expires_at:%Y-%m-%d %H:%M} UTC."
        )
    if scope is not None and scope not in key.scopes and ClientKey.Scope.ADMIN not in key.scopes:
        raise ClientKeyError(
            "insufficient_scope",
            f"The API key {key.masked} does not have the '{scope}' scope (it has: {', '.join(key.scopes) or 'none'}).",
            status=403,
        )
    _record_use(key, now)
    return key


@functools.cache
def _key_statement() -> tuple[Rows, str]:
    workspace = ClientKey._meta.get_field("workspace").related_model
    rows = Rows((ClientKey, "k"), (workspace, "w"))
    tables = f"{ClientKey._meta.db_table} k JOIN {workspace._meta.db_table} w ON w.id = k.workspace_id"
    return rows, f"SELECT {rows.columns} FROM {tables} WHERE k.prefix = %s"  # noqa: S608


def _key_with_workspace(prefix: str) -> ClientKey | None:
    """The key with this prefix (unique) and its workspace, or None."""
    rows, sql = _key_statement()
    row = fetch_one(sql, [prefix])
    if row is None:
        return None
    key, workspace = rows.instances(row)
    key.workspace = workspace
    return key


def _record_use(key: ClientKey, now: datetime) -> None:
    if key.last_used_at is not None and now - key.last_used_at < LAST_USED_EVERY:
        return
    fresh = Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - LAST_USED_EVERY)
    ClientKey.objects.filter(fresh, pk=key.pk).update(last_used_at=now)
    key.last_used_at = now


def client_key_revoke(key: ClientKey, *, reason: str = "", now: datetime | None = None, by=None, request=None) -> None:
    """Refuse the key from now on (kept for the ledger's sake, never deleted by this); ``by``:
    the user who revoked it, for the audit log (None: the operator's tools)."""
    if key.revoked_at is None:
        key.revoked_at = now or timezone.now()
        key.revoked_reason = reason[:200]
        ClientKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(
            revoked_at=key.revoked_at, revoked_reason=key.revoked_reason
        )
        audit_record(
            Action.KEY_REVOKE,
            user=by,
            actor=None if by is not None else "operator",
            request=request,
            workspace_id=key.workspace_id,
            target=f"key:{key.pk}",
            detail={"name": key.name, "reason": key.revoked_reason},
        )


def bearer_token(request) -> str | None:
    """The key from ``Authorization: Bearer ...`` (the OpenAI SDK's way), if any."""
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None
