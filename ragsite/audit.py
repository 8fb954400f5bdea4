"""The audit log: one append-only row per sign-in, search, question, document opened or
downloaded, change of a document's readers, and API key created or revoked
(``ragsite.models.AuditEvent``; docs/access.md, "Audit log"). It loads with the app registry
(``ragsite.apps`` connects the sign-in signals), before the models: it reads them through it.

``audit_record`` is called where the action happens, with the request when there is one (the
client's address and user agent, the request id of the logs). Writing an event never fails the
action it records: a database error is logged, with the event, and the action goes on (an
outage of the audit table must not stop searches; the log line is the trace of what was lost).
Sign-ins, refused sign-ins and sign-outs, whichever backend signed in (password, SSO), come
from Django's auth signals (``signals_connect``).
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.apps import apps
from django.conf import settings
from django.contrib.auth import signals
from django.db import DatabaseError, models, transaction
from django.utils import timezone

from ragsite.logs import current_request_id

logger = logging.getLogger(__name__)

# The database refuses to delete an event younger than this (the trigger of migration 0002).
RETENTION_FLOOR_DAYS = 365


class Action(models.TextChoices):
    SIGN_IN = "sign_in", "Signed in"
    SIGN_IN_FAILED = "sign_in_failed", "Sign-in refused"
    SIGN_OUT = "sign_out", "Signed out"
    SEARCH = "search", "Searched"
    ASK = "ask", "Asked"
    DOCUMENT_OPEN = "document_open", "Opened a document"
    DOCUMENT_DOWNLOAD = "document_download", "Downloaded a document"
    READERS_CHANGE = "readers_change", "Changed who may read a document"
    KEY_CREATE = "key_create", "Created an API key"
    KEY_REVOKE = "key_revoke", "Revoked an API key"


# Questions and queries are kept whole up to this many characters.
DETAIL_TEXT_MAX_CHARS = 2000


def actor_of(*, user=None, key=None) -> tuple[str, str]:
    """(actor, actor_name) of a user, a client key (``billing.models.ClientKey``), or neither."""
    if key is not None:
        return f"key:{key.pk}", key.name
    if user is not None and getattr(user, "is_authenticated", False):
        return f"user:{user.pk}", user.get_username()
    return "anonymous", ""


def audit_record(
    action: str,
    *,
    user=None,
    key=None,
    actor: str | None = None,
    request=None,
    workspace_id: int | None = None,
    target: str = "",
    outcome: str = "ok",
    detail: dict | None = None,
) -> models.Model | None:
    """Append one event. ``actor``: given outright ("operator"), else that of ``key`` or
    ``user``. Returns the event, or None when it could not be written (logged)."""
    actor_id, actor_name = (actor, "") if actor is not None else actor_of(user=user, key=key)
    AuditEvent = apps.get_model("ragsite", "AuditEvent")  # this module loads before the models do
    detail = {
        name: value[:DETAIL_TEXT_MAX_CHARS] if isinstance(value, str) else value
        for name, value in (detail or {}).items()
    }
    event = AuditEvent(
        action=action,
        actor=actor_id,
        actor_name=actor_name[:200],
        workspace_id=workspace_id,
        target=target[:100],
        outcome=outcome,
        client_ip=_client_ip(request),
        user_agent=(request.META.get("HTTP_USER_AGENT", "") if request is not None else "")[:300],
        request_id=current_request_id() or "",
        detail=detail,
    )
    try:
        with transaction.atomic():  # a savepoint: a failure leaves the caller's transaction usable
            event.save()
    except DatabaseError:
        logger.exception("audit event not written: %s %s %s %s", action, actor_id, target, outcome)
        return None
    return event


def _client_ip(request) -> str | None:
    """The client's address: REMOTE_ADDR, which a deployment behind a proxy sets from the
    proxy's header (docs/deploy.md); never a header the client could forge itself."""
    if request is None:
        return None
    return request.META.get("REMOTE_ADDR") or None


def audit_purge(*, now=None) -> int:
    """Delete events older than ``AUDIT_RETENTION_DAYS`` (never under the database's floor,
    ``RETENTION_FLOOR_DAYS``); returns how many went."""
    days = max(settings.AUDIT_RETENTION_DAYS, RETENTION_FLOOR_DAYS)
    cutoff = (now or timezone.now()) - timedelta(days=days)
    deleted, _ = apps.get_model("ragsite", "AuditEvent").objects.filter(at__lt=cutoff).delete()
    return deleted


def signals_connect() -> None:
    """Record sign-ins, refused sign-ins and sign-outs (called once, by ``ragsite.apps``)."""
    signals.user_logged_in.connect(_signed_in, dispatch_uid="ragsite.audit.signed_in")
    signals.user_logged_out.connect(_signed_out, dispatch_uid="ragsite.audit.signed_out")
    signals.user_login_failed.connect(_refused, dispatch_uid="ragsite.audit.refused")


def _signed_in(sender, request, user, **_):
    audit_record(Action.SIGN_IN, user=user, request=request, detail={"backend": getattr(user, "backend", "")})


def _signed_out(sender, request, user, **_):
    audit_record(Action.SIGN_OUT, user=user, request=request)


def _refused(sender, credentials, request=None, **_):
    # The name tried, never the password (Django's cleanse masks it anyway).
    name = str(credentials.get("username", ""))[:200]
    audit_record(Action.SIGN_IN_FAILED, request=request, outcome="refused", detail={"username": name})
